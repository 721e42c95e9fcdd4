#!/usr/bin/env python3
"""The real texts bench prompts are cut from, and what a chat prompt asks of each kind: license
texts (this repo's LICENSE and the venv's dist-info), changelogs (the venv's package descriptions)
and source code (mlx-lm's models and vLLM's engine core, as pinned in the venv)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTION = (
    "Summarize the text above in detail: which licenses appear, what each one allows, "
    "and what each one requires when the software is redistributed."
)
# What a chat prompt asks of each kind of text (`corpora`).
QUESTIONS = {
    "licenses": QUESTION,
    "changelogs": "Summarize the changes above release by release: what was added, what was fixed, "
                  "and what could break a program that upgrades.",
    "code": "Explain what the code above does, function by function, and point out anything that looks "
            "like a bug.",
}


def corpus() -> str:
    """Real prose: this repo's LICENSE and every distinct license text in the venv's dist-info."""
    files = [ROOT / "LICENSE"]
    site = sorted((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
    for sp in site:
        for info in sorted(sp.glob("*.dist-info")):
            for f in sorted(info.rglob("*")):
                if f.is_file() and re.match(r"(?i)(licen[cs]e|copying|notice|authors)", f.name):
                    files.append(f)
    seen, parts = set(), []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        text = re.sub(r"[ \t]+\n", "\n", text).strip()
        digest = hashlib.sha256(text.encode()).digest()
        if len(text) < 200 or digest in seen:
            continue
        seen.add(digest)
        parts.append(text)
    if not parts:
        raise SystemExit("no license texts found for the corpus")
    return "\n\n----\n\n".join(parts)


def changelogs() -> str:
    """Real release notes: the changelog sections of the venv's package descriptions (METADATA)."""
    heading = re.compile(r"(?im)^#*\s*(changelog|change log|release notes|history|changes)\b.*$")
    parts = []
    for meta in sorted((ROOT / ".venv" / "lib").glob("python3*/site-packages/*.dist-info/METADATA")):
        description = meta.read_text(encoding="utf-8", errors="replace").partition("\n\n")[2]
        found = heading.search(description)
        if found and len(description) - found.start() >= 2000:
            parts.append(description[found.start():].strip())
    if not parts:
        raise SystemExit("no changelogs found in the venv's package descriptions")
    return "\n\n----\n\n".join(parts)


def source_code() -> str:
    """Real source: mlx-lm's model files and vLLM's engine core, as pinned in the venv."""
    site = sorted((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
    files = [f for sp in site for pattern in ("mlx_lm/models/*.py", "vllm/v1/core/*.py", "vllm/v1/core/sched/*.py")
             for f in sorted(sp.glob(pattern))]
    parts = [f"# file: {f.relative_to(f.parents[2])}\n{f.read_text(encoding='utf-8')}" for f in files
             if f.stat().st_size >= 2000]
    if not parts:
        raise SystemExit("no mlx-lm or vLLM sources found for the code corpus")
    return "\n\n".join(parts)


def corpora() -> dict[str, str]:
    """Three kinds of real text, each asked about with its own question (QUESTIONS)."""
    return {"licenses": corpus(), "changelogs": changelogs(), "code": source_code()}
