"""Fixtures of the trainer tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def mg_model_dir(tmp_path_factory):
    """A tiny Qwen2 folder with two decoder blocks, grouped-query attention and
    non-trivial weights (a random init plus noise: every layout slip shows)."""
    from rollart.model import build_tiny_model, load_model

    path = build_tiny_model(tmp_path_factory.mktemp("mg") / "m",
                            ["gridnav : goal 3 right 1 up ; act ? left down , stop ."],
                            hidden_size=64, num_heads=4)
    model = load_model(path)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)
