"""Hyperparameter sweeps on Optuna: the search space, the study and its storage, the pruner
that runs inside the training job, and the sweep's record in the store.

No Prefect here: the flow (`flows/sweep.py`) packs trials onto the machine and runs each
through `train_and_evaluate`; a trial's rank 0 reports to the study from its torchrun job.
"""
