"""Where a step logs: MLFLOW_TRACKING_URI, else the repository's sqlite file, also from the copy
a queued DVC experiment runs in (DVC deletes that copy, and a store inside it, afterwards)."""

from pathlib import Path

from draftport.pipeline import tracking


def test_default_store_is_the_repos_file(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert tracking.dvc_exp_root() is None
    assert tracking.tracking_uri() == "sqlite:///mlflow.db"


def test_a_queued_experiments_copy_logs_to_the_repo_it_came_from(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    copy = tmp_path / "repo" / ".dvc" / "tmp" / "exps" / "tmpab12cd"
    (copy / "artifacts").mkdir(parents=True)
    monkeypatch.chdir(copy / "artifacts")
    assert tracking.dvc_exp_root() == (tmp_path / "repo").resolve()
    uri = tracking.tracking_uri()
    assert uri == f"sqlite:///{(tmp_path / 'repo' / 'mlflow.db').resolve()}"
    assert Path(uri[len("sqlite:///") :]).is_absolute()


def test_the_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    monkeypatch.chdir(tmp_path)
    assert tracking.tracking_uri() == "http://127.0.0.1:5999"
