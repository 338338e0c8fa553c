"""The pipeline driver: a Prefect flow that runs each DVC stage of dvc.yaml in order (see pipelines/flow.py).

    loupe run                                  the flow on params.yaml, ephemeral Prefect, summary at the end
    python -m pipelines.flow [--stages eval]   the same without the CLI
    prefect deploy --all                       the deployments of prefect.yaml, against a Prefect server

DVC decides what runs (a stage whose inputs did not change is skipped); Prefect schedules, retries and shows
the chain; MLflow records it (a parent run, one child run per stage). `pipelines.data_stage` is the `data`
stage itself (the tiny model and the synthetic tasks).
"""
