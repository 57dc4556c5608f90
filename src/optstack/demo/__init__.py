"""optstack.demo: what ``optstack train`` runs, a small byte-level GPT trained on the Python stdlib's source.

Modules: ``data`` (the corpus, split and batches), ``gpt`` (the model), ``config`` (the run's typed, TOML
configuration), ``train`` (the loop), ``rundir`` (config, metrics and checkpoint files), ``plots`` (PNGs).
"""
