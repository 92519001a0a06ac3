"""Test-suite set-up: modules that need torch are skipped where torch is not installed.

CI runs the library tests (``-m flower_compat``) a second time against the newest
Flower in an environment without torch; there the task-layer modules cannot import.
"""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("torch") is None:
    collect_ignore = [
        "test_data_sources.py",
        "test_data_partitions.py",
        "test_models.py",
        "test_task_train.py",
        "test_flwr_run.py",
        "test_deploy_e2e.py",
        "test_cuda_training.py",
    ]
