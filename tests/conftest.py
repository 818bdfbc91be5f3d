import pytest
import torch

from lodestar.formats.catalog import ModelNotFoundError, known_model_path

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


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
