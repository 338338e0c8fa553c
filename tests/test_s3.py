"""S3: the DVC remote and MLflow artefacts on an S3-compatible store, against a real S3 server on loopback.

moto's server mode speaks the S3 HTTP API on 127.0.0.1; everything reaches it exactly as it would reach AWS,
MinIO or Ceph: configured by the environment alone (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID/SECRET_ACCESS_KEY,
LOUPE_DVC_REMOTE, LOUPE_ARTIFACT_ROOT). The secret key must never land in a config file, log or MLflow.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_orchestration import _git, make_fake_repo

from pipelines.dvc_runner import (
    configure_remote_from_env,
    dvc_text,
    repro_stage,
    stage_environment,
)

BUCKET = "loupe-test"
SECRET = f"loupe-secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    """The environment a user sets for an S3-compatible store, and a fresh bucket; returns a boto3 client."""
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "loupe-test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_PROFILE", "MLFLOW_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    client = boto3.client("s3")
    if BUCKET not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket=BUCKET)
    return client


def keys(client, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def test_dvc_push_then_pull_into_a_fresh_clone(tmp_path, s3, monkeypatch):
    monkeypatch.setenv("LOUPE_TRACKING", "off")
    monkeypatch.setenv("LOUPE_DVC_REMOTE", f"s3://{BUCKET}/dvc-{uuid.uuid4().hex[:8]}")
    repo = make_fake_repo(tmp_path / "repo")
    for stage in ("make", "use"):
        repro_stage(stage, repo, stage_environment(), echo=False)
    _git(repo, "add", "dvc.lock")
    _git(repo, "commit", "-q", "-m", "outputs")

    assert configure_remote_from_env(repo) == os.environ["LOUPE_DVC_REMOTE"]
    pushed = dvc_text(repo, "push")
    prefix = os.environ["LOUPE_DVC_REMOTE"].removeprefix(f"s3://{BUCKET}/")
    assert len(keys(s3, prefix)) >= 4  # the task file, the model's config, two metrics files (plus .dir lists)

    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "-q", str(repo), str(clone))
    assert not (clone / "out").exists()
    configure_remote_from_env(clone)  # the local config is not cloned; the same environment sets it again
    dvc_text(clone, "pull")
    for path in ("out/tasks/train.jsonl", "out/use/model/config.json", "out/use/metrics.json"):
        assert (clone / path).read_bytes() == (repo / path).read_bytes(), path
    status = dvc_text(clone, "status")
    assert "up to date" in status
    # Credentials stayed in the environment: not in DVC's configs, not in what the commands printed.
    for text in ((repo / ".dvc" / "config").read_text(), (repo / ".dvc" / "config.local").read_text(), pushed, status):
        assert SECRET not in text and "loupe-test-key" not in text
    assert "url = s3://" in (repo / ".dvc" / "config.local").read_text()
    assert "s3://" not in (repo / ".dvc" / "config").read_text()  # the git-tracked config names no bucket


def test_mlflow_artefacts_and_registered_model_round_trip_through_s3(tmp_path, s3, monkeypatch):
    import mlflow

    from loupe.tracking import register_model, stage_run

    root = f"s3://{BUCKET}/mlflow-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("LOUPE_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("LOUPE_ARTIFACT_ROOT", root)
    monkeypatch.setenv("LOUPE_EXPERIMENT", "s3")
    monkeypatch.delenv("LOUPE_PARENT_RUN_ID", raising=False)
    report = tmp_path / "metrics.json"
    report.write_text('{"accuracy": 0.75}\n')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    (model / "weights.bin").write_bytes(os.urandom(200_000))

    with stage_run("eval", params={"eval": {"samples": 2}}) as run:
        run.log_metrics({"accuracy": 0.75})
        run.log_artifact(report)
    version = register_model(model, "loupe-s3", run.run_id, tags={"dvc.md5": "abc"})

    assert mlflow.get_run(run.run_id).info.artifact_uri.startswith(root)
    prefix = root.removeprefix(f"s3://{BUCKET}/")
    stored = keys(s3, prefix)
    assert any(k.endswith("/artifacts/metrics.json") for k in stored)
    assert any(k.endswith("/artifacts/model/weights.bin") for k in stored)

    fetched = Path(mlflow.artifacts.download_artifacts(run_id=run.run_id, artifact_path="metrics.json",
                                                       dst_path=str(tmp_path / "fetched")))
    assert fetched.read_text() == report.read_text()
    loaded = Path(mlflow.artifacts.download_artifacts(f"models:/loupe-s3/{version.version}",
                                                      dst_path=str(tmp_path / "registry")))
    assert (loaded / "weights.bin").read_bytes() == (model / "weights.bin").read_bytes()

    # Nothing secret in the runs' params and tags, nor anywhere in the store's database.
    recorded = mlflow.get_run(run.run_id).data
    assert all(SECRET not in str(v) for v in [*recorded.params.values(), *recorded.tags.values()])
    assert SECRET.encode() not in (tmp_path / "mlflow.db").read_bytes()


def test_loupe_remote_command_needs_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("LOUPE_DVC_REMOTE", raising=False)
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", "remote"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 2 and "LOUPE_DVC_REMOTE is not set" in done.stderr
