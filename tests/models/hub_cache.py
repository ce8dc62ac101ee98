"""A Hugging Face hub cache written on disk as ``huggingface_hub`` writes it (test helper).

``<cache>/models--<org>--<name>/`` holds ``blobs/<sha256>`` (each file's bytes once),
``snapshots/<commit>/<path>`` (relative symlinks into blobs) and ``refs/<branch or tag>`` (the
commit hash, no newline). Resolving through ``huggingface_hub`` offline reads exactly this, so the
tests exercise its own code with no network.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def add_snapshot(cache: Path, repo_id: str, files: dict[str, bytes], *, refs: tuple[str, ...] = ("main",),
                 commit: str | None = None) -> str:
    """Store ``files`` (path in the repo -> bytes) as one commit of ``repo_id``, pointed at by
    ``refs``; returns the commit hash."""
    repo = repo_folder(cache, repo_id)
    commit = commit or hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return commit


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def add_tree_listing(cache: Path, repo_id: str, commit: str, paths: list[str]) -> None:
    """The listing of every file of ``commit`` on the hub (``trees/<commit>.json``, which
    ``huggingface_hub`` writes on an online download and checks a snapshot against offline)."""
    files = {p: {"size": 1, "blob_id": hashlib.sha1(p.encode()).hexdigest()} for p in paths}
    tree = repo_folder(cache, repo_id) / "trees" / f"{commit}.json"
    tree.parent.mkdir(parents=True, exist_ok=True)
    tree.write_text(json.dumps({"format_version": 1, "files": files}))
