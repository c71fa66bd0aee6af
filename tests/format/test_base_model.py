"""An adapter's base_model_name_or_path against the names a served model goes by (adapter_fabric.format.base_model)."""

from __future__ import annotations

import pytest

from adapter_fabric.format.base_model import base_model_matches


@pytest.mark.parametrize(
    ("adapter", "served"),
    [
        ("tiny", ["tiny"]),
        ("TINY", ["tiny"]),  # without case
        ("meta-llama/Llama-3.1-8B-Instruct", ["meta-llama/Llama-3.1-8B-Instruct"]),
        ("meta-llama/Llama-3.1-8B-Instruct", ["/models/Llama-3.1-8B-Instruct"]),  # a model directory by its name
        ("meta-llama/Llama-3.1-8B-Instruct", ["/models/llama-3.1-8b-instruct/"]),
        ("meta-llama/Llama-3.1-8B-Instruct", ["Llama-3.1-8B-Instruct"]),  # a served name without the organisation
        ("/home/me/models/llama-3.1-8b-instruct", ["meta-llama/Llama-3.1-8B-Instruct"]),  # an adapter trained on a local copy
        ("meta-llama/Llama-3.1-8B-Instruct", ["/root/.cache/huggingface/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/0e9e39f2"]),
        ("meta-llama/Llama-3.1-8B-Instruct", ["/models/base", "meta-llama/Llama-3.1-8B-Instruct"]),  # an explicit alias
        (None, ["tiny"]),  # an adapter naming no base model claims nothing
        ("", ["tiny"]),
    ],
)
def test_names_operators_write_match(adapter, served) -> None:
    assert base_model_matches(adapter, served)


@pytest.mark.parametrize(
    ("adapter", "served"),
    [
        ("tiny-qwen2", ["tiny"]),  # the case of issue 33: promoted on a tiny node
        ("meta-llama/Llama-3.1-8B-Instruct", ["/models/base"]),  # mounted under another name: needs the alias
        ("meta-llama/Llama-3.1-8B-Instruct", ["meta-llama/Llama-3.1-70B-Instruct"]),
        ("meta-llama/Llama-3.1-8B-Instruct", []),
        ("llama", ["/models/llama-2"]),
    ],
)
def test_another_model_does_not(adapter, served) -> None:
    assert not base_model_matches(adapter, served)
