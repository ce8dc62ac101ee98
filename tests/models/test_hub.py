"""Model sources: local folders, and hub ids resolved through ``huggingface_hub``'s own offline path
against a hub cache laid out on disk as it writes one. No test reaches a network: every hub
lookup runs with ``HF_HUB_OFFLINE=1``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from jaxserve.exceptions import ConfigError
from jaxserve.models.hub import resolve_model
from tests.models.hub_cache import add_snapshot, add_tree_listing, folder_files, repo_folder

REPO = "jaxserve-test/demo"


@pytest.fixture
def offline(monkeypatch, tmp_path) -> Path:
    """HF_HUB_OFFLINE=1 and an empty hub cache at HF_HUB_CACHE; returns the cache folder."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def demo_files(demo_model) -> dict[str, bytes]:
    return folder_files(Path(demo_model))


def test_hub_id_resolves_to_the_cached_snapshot(offline, demo_files):
    commit = add_snapshot(offline, REPO, demo_files)
    source = resolve_model(REPO)
    assert source.path == repo_folder(offline, REPO) / "snapshots" / commit
    assert (source.root, source.revision) == (REPO, commit)
    assert folder_files(source.path) == demo_files


def test_revision_by_tag_and_by_commit(offline, demo_files):
    main = add_snapshot(offline, REPO, demo_files)
    tagged = add_snapshot(offline, REPO, {**demo_files, "generation_config.json": b"{}"}, refs=("v1",))
    assert main != tagged
    assert resolve_model(REPO).revision == main
    assert resolve_model(REPO, revision="v1").revision == tagged
    assert resolve_model(REPO, revision=main).revision == main


def test_download_dir_and_hf_home(monkeypatch, tmp_path, demo_files):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    add_snapshot(tmp_path / "home" / "hub", REPO, demo_files)
    assert resolve_model(REPO).path.is_relative_to(tmp_path / "home" / "hub")
    add_snapshot(tmp_path / "elsewhere", REPO, demo_files)
    assert resolve_model(REPO, download_dir=str(tmp_path / "elsewhere")).path.is_relative_to(tmp_path / "elsewhere")


def test_unknown_id_offline_says_so(offline):
    with pytest.raises(ConfigError, match=r"nobody/nothing is not in the hub cache .*HF_HUB_OFFLINE is set"):
        resolve_model("nobody/nothing")


def test_missing_revision_offline_names_the_cached_ones(offline, demo_files):
    add_snapshot(offline, REPO, demo_files, refs=("main", "v1"))
    with pytest.raises(ConfigError, match=r"revision 'v9' of jaxserve-test/demo is not in the hub cache .*"
                                          r"holds main, v1, .*HF_HUB_OFFLINE is set"):
        resolve_model(REPO, revision="v9")


def test_pickle_only_repo_is_refused(offline, demo_files):
    files = {k: v for k, v in demo_files.items() if not k.endswith(".safetensors")}
    add_snapshot(offline, "jaxserve-test/pickled", {**files, "pytorch_model.bin": b"never unpickled"})
    with pytest.raises(ConfigError, match=r"jaxserve-test/pickled .*no \*\.safetensors weights; jaxserve never "
                                          r"loads pickle"):
        resolve_model("jaxserve-test/pickled")



def test_an_eagle_head_may_be_a_pytorch_model_bin(offline, demo_files, tmp_path):
    """``state_dict_bin`` (EAGLE heads): a repo or folder whose only weights are pytorch_model.bin
    resolves (jaxserve.models.torch_pickle reads it without running it); other pickles do not."""
    files = {k: v for k, v in demo_files.items() if not k.endswith(".safetensors")}
    add_snapshot(offline, "jaxserve-test/head", {**files, "pytorch_model.bin": b"read by torch_pickle"})
    assert (resolve_model("jaxserve-test/head", state_dict_bin=True).path / "pytorch_model.bin").is_file()
    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "config.json").write_bytes(files["config.json"])
    (folder / "pytorch_model.bin").write_bytes(b"read by torch_pickle")
    assert resolve_model(str(folder), state_dict_bin=True).path == folder.resolve()
    with pytest.raises(ConfigError, match="pickle"):
        resolve_model(str(folder))
    (folder / "pytorch_model.bin").rename(folder / "model.bin")
    with pytest.raises(ConfigError, match="pickle"):
        resolve_model(str(folder), state_dict_bin=True)


def test_pickles_and_code_are_not_part_of_the_snapshot(offline, demo_files):
    """Offline, huggingface_hub checks the snapshot against the hub's file listing, filtered by
    the patterns asked for: with the repo's *.bin and *.py absent, the snapshot is complete only
    because they are never asked for. A missing safetensors shard is noticed."""
    # huggingface_hub keeps a listing in memory once read: each case gets a commit of its own.
    partial = add_snapshot(offline, REPO, demo_files, refs=("partial",))
    add_tree_listing(offline, REPO, partial, [*demo_files, "model-00002-of-00002.safetensors"])
    with pytest.raises(ConfigError, match=r"incomplete.*model-00002-of-00002\.safetensors"):
        resolve_model(REPO, revision="partial")
    whole = add_snapshot(offline, REPO, {**demo_files, "README.md": b"demo"})
    add_tree_listing(offline, REPO, whole, [*demo_files, "README.md", "pytorch_model.bin", "modeling_custom.py"])
    assert resolve_model(REPO).revision == whole


def test_local_folders(tmp_path, demo_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(demo_model, tmp_path / "demo")
    source = resolve_model("demo")
    assert (source.path, source.root, source.revision) == (tmp_path / "demo", str(tmp_path / "demo"), None)
    with pytest.raises(ConfigError, match="model: no such folder: ./nope"):
        resolve_model("./nope")
    with pytest.raises(ConfigError, match="model: no such folder: a/b/c"):
        resolve_model("a/b/c")
    with pytest.raises(ConfigError, match="is a file"):
        resolve_model("demo/config.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json in"):
        resolve_model("empty")
    for weights in (tmp_path / "demo").glob("*.safetensors"):
        weights.rename(weights.with_suffix(".bin"))
    with pytest.raises(ConfigError, match=r"holds only pickle files \(model\.bin\)"):
        resolve_model("demo")
    assert resolve_model("demo", weights=False).root == str(tmp_path / "demo")  # a tokenizer needs no weights


def test_llm_serves_a_hub_id_from_the_cache(offline, demo_files):
    from jaxserve import LLM, SamplingParams
    from tests.shapes import ENGINE_TESTS_SHAPE

    add_snapshot(offline, REPO, demo_files)
    llm = LLM(REPO, show_progress=False, **ENGINE_TESTS_SHAPE)
    assert (llm.llm_engine.model_root, llm.llm_engine.served_model_name) == (REPO, REPO)
    out = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.text == llm.get_tokenizer().decode(out.token_ids)
