"""An EAGLE-1 head published as ``pytorch_model.bin`` only (as many are): the same random head saved
as safetensors and as a ``torch.save`` state dict (torch only writes it; jaxserve reads it without
torch, jaxserve.models.torch_pickle) makes the same drafts, token for token."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.models.safetensors_io import SafetensorsFile
from tests.eagle_heads import write_eagle_head
from tests.shapes import ENGINE_TESTS_SHAPE
from tests.spec_helpers import prompts, token_ids

torch = pytest.importorskip("torch")

K = 3
SPEC_SHAPE = {**ENGINE_TESTS_SHAPE, "num_gpu_blocks_override": 80}


def drafts_of(llm: LLM, monkeypatch, ps: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
    """(generated tokens, every non-empty proposal in order) for greedy ``ps``."""
    head = llm.llm_engine.core.runner.eagle
    seen: list[list[int]] = []

    def spy(name: str) -> None:  # propose, or with the overlap (the default) collect_on_device
        method = getattr(head, name)

        def recorded(*args):
            out = method(*args)
            seen.extend(d for d in out if d)
            return out

        monkeypatch.setattr(head, name, recorded)

    spy("propose")
    spy("collect_on_device")
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return token_ids(outs), seen


def test_a_pytorch_model_bin_head_drafts_as_its_safetensors_twin(demo_model, tmp_path, monkeypatch):
    st = write_eagle_head(tmp_path / "st", demo_model, "eagle", seed=4, fc_bias=True)
    file = SafetensorsFile(f"{st}/model.safetensors")
    tensors = {name: torch.from_numpy(np.array(file.get(name))) for name in file.keys()}
    del file
    # As published heads are: transposed views and parameters are stored by reference to a storage.
    tensors["fc.weight"] = tensors["fc.weight"].t().contiguous().t()
    tensors["layers.0.mlp.up_proj.weight"] = torch.nn.Parameter(tensors["layers.0.mlp.up_proj.weight"])
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    (bin_folder / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save(tensors, bin_folder / "pytorch_model.bin")
    assert not any(bin_folder.glob("*.safetensors"))

    ps = prompts(3, seed=7)
    results = []
    for head in (st, str(bin_folder)):
        llm = LLM(demo_model, show_progress=False, **SPEC_SHAPE,
                  speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": K})
        results.append(drafts_of(llm, monkeypatch, ps))
        assert llm.stats()["compile_unexpected_compiles"] == 0
        del llm
    (tokens_st, drafts_st), (tokens_bin, drafts_bin) = results
    assert len(drafts_st) >= 6 and all(len(d) == K for d in drafts_st)
    assert drafts_bin == drafts_st and tokens_bin == tokens_st
