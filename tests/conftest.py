import pytest
import torch

from lodestar.formats.catalog import ModelNotFoundError, known_model_path

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session", autouse=True)
def _private_user_dirs(tmp_path_factory):
    """No test touches the user's real agent database, history, config or KV cache."""
    import os
    base = tmp_path_factory.mktemp("user")
    saved = {k: os.environ.get(k) for k in ("XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")}
    for k in saved:
        os.environ[k] = str(base / k.lower())
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _model(name: str):
    try:
        return known_model_path(name)
    except ModelNotFoundError as e:  # make test installs both; a bare checkout may not
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm_path():
    return _model("default")


@pytest.fixture(scope="session")
def gemma_path():
    return _model("gemma3-270m")
