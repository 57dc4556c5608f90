"""optstack.demo: what ``optstack train`` runs, a small byte-level GPT trained on the Python stdlib's source.

Modules: ``data`` (the corpus, split and batches), ``gpt`` (the model), ``config`` (the run's typed, TOML
configuration), ``train`` (the loop, one rank of it), ``launch`` (``--nproc N``: N processes, gloo or NCCL),
``rundir`` (config, metrics, checkpoints and the loop's train state), ``progress`` (progress bar,
TensorBoard), ``plots`` (PNGs), ``compare`` (``optstack compare``: several optimizers side by side).
"""
