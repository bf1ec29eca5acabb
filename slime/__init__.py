"""slime on Prefect: the post-training library (no orchestration code lives here).

Stages are plain functions under this package; `tasks/` and `flows/` wrap them for Prefect.
"""

__version__ = "0.1.0"
