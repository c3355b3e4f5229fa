"""Rebuild the bundled evaluation data (slotune/evals/tasks/*/test.jsonl, slotune/evals/data/*.jsonl) from its sources.

Sources (see slotune/evals/tasks/SOURCES.md for licenses):
- BIG-bench task JSONs from the `bigbench` 1.0.0 sdist on PyPI:
    pip download --no-deps --no-binary :all: bigbench==1.0.0 -d /tmp/bb
- King James Version text via Debian's `bible-kjv` program (packages bible-kjv, bible-kjv-text):
    apt-get install bible-kjv
- GNU GPL v3 text, Debian base-files: /usr/share/common-licenses/GPL-3

Usage: python bench/evals/extract_data.py /tmp/bb/bigbench-1.0.0.tar.gz
Deterministic: the same sources give byte-identical files.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "slotune" / "evals" / "tasks"
DATA = ROOT / "slotune" / "evals" / "data"

# folder -> path of the task.json inside the sdist's bigbench/benchmark_tasks/
BIGBENCH = {
    "arithmetic_1digit": "arithmetic/1_digit_addition/task.json",
    "general_knowledge": "general_knowledge/task.json",
    "code_line_description": "code_line_description/task.json",
}

# Perplexity: the first 8 verses of chapter 1 of every other book (diverse authors and genres).
KJV_BOOKS = [
    "Genesis",
    "Exodus",
    "Leviticus",
    "Numbers",
    "Deuteronomy",
    "Joshua",
    "Judges",
    "Ruth",
    "1Samuel",
    "2Samuel",
    "1Kings",
    "2Kings",
    "1Chronicles",
    "2Chronicles",
    "Ezra",
    "Nehemiah",
    "Esther",
    "Job",
    "Psalms",
    "Proverbs",
    "Ecclesiastes",
    "Isaiah",
    "Jeremiah",
    "Lamentations",
    "Ezekiel",
    "Daniel",
    "Hosea",
    "Joel",
    "Amos",
    "Jonah",
    "Micah",
    "Nahum",
    "Habakkuk",
    "Zephaniah",
    "Haggai",
    "Zechariah",
    "Malachi",
    "Matthew",
    "Mark",
    "Luke",
    "John",
    "Acts",
    "Romans",
    "1Corinthians",
    "2Corinthians",
    "Galatians",
    "Ephesians",
    "Philippians",
    "Colossians",
    "1Thessalonians",
    "1Timothy",
    "2Timothy",
    "Titus",
    "Hebrews",
    "James",
    "1Peter",
    "2Peter",
    "1John",
    "Jude",
    "Revelation",
]
KJV_PERPLEXITY = KJV_BOOKS[0::2]  # 30 passages
KJV_AGREEMENT = KJV_BOOKS[1::2][:16]  # disjoint from the perplexity passages
GPL3 = Path("/usr/share/common-licenses/GPL-3")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{path.relative_to(ROOT)}: {len(rows)} rows, {path.stat().st_size} bytes")


def bigbench(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        for folder, inner in BIGBENCH.items():
            member = next(m for m in tar.getmembers() if m.name.endswith("bigbench/benchmark_tasks/" + inner))
            task = json.load(tar.extractfile(member))
            rows = []
            for i, ex in enumerate(task["examples"]):
                choices = list(ex["target_scores"])
                scores = list(ex["target_scores"].values())
                label = scores.index(max(scores))
                rows.append(
                    {"id": i, "input": ex["input"], "choices": choices, "label": label, "target": choices[label]}
                )
            write_jsonl(TASKS / folder / "test.jsonl", rows)


def kjv(book: str, verses: str = "1:1-8") -> str:
    out = subprocess.run(["bible", "-f", f"{book}{verses}"], capture_output=True, text=True, check=True).stdout
    lines = [re.sub(r"^\S+\d+:\d+\s+", "", ln).strip() for ln in out.splitlines() if ln.strip()]
    return " ".join(lines)


def gpl3_paragraphs() -> list[str]:
    paras = [" ".join(p.split()) for p in GPL3.read_text().split("\n\n")]
    return [p for p in paras if len(p) >= 400]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    bigbench(Path(argv[0]))
    write_jsonl(
        TASKS / "kjv_perplexity" / "test.jsonl",
        [{"id": i, "ref": f"{b} 1:1-8", "text": kjv(b)} for i, b in enumerate(KJV_PERPLEXITY)],
    )
    prompts = [{"source": "KJV", "ref": f"{b} 1:1-8", "text": kjv(b)} for b in KJV_AGREEMENT]
    paras = gpl3_paragraphs()
    step = len(paras) / 16
    prompts += [
        {"source": "GPL-3", "ref": f"paragraph {int(i * step)}", "text": paras[int(i * step)]} for i in range(16)
    ]
    write_jsonl(DATA / "agreement_prompts.jsonl", prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
