"""The documentation's commands run as written.

Every ```bash and ```python block of README.md, docs/*.md and benchmarks/README.md runs, each in
a fresh temporary directory, with the project's interpreter's folder first on PATH (so ``tessera``
and ``python`` are the project's) and TESSERA_DATA at the Planetoid files (a block that names
Cora, CiteSeer or PubMed needs them: under CI=true a missing dataset fails, elsewhere the block is
skipped). A bash block runs under ``bash -e -o pipefail`` and must exit 0; a Python block runs with
the same interpreter and must exit 0 (docs/architecture.md's backend example runs in
tests/test_architecture.py instead, where its results are checked). The blocks run side by side,
one per core, so the module takes about half their summed time on two cores.

The subset that does not run is stated in the documents themselves: a block fenced ```bash norun
(or ```python norun) is shown only, and its first line is a ``# norun: <reason>`` comment (long
benchmarks, builds from PyPI, several worker processes on a small machine, a cluster). Shell blocks
in any other fence (sh, shell, console) are refused, so none escapes the check. The README also
stays short, and the documents' relative links resolve.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_architecture import readme_backend_example

pytestmark = pytest.mark.distributed  # some blocks start worker processes (--nprocs 2)

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
PAGES = [
    "README",
    "datasets-and-formats",
    "models",
    "python-api",
    "distributed",
    "planner",
    "communication",
    "reliability",
    "architecture",
]
RUNNABLE = ("bash", "python")
OTHER_SHELLS = ("sh", "shell", "console", "zsh", "shell-session")
NEEDS_PLANETOID = re.compile(r"\b(cora|citeseer|pubmed)\b", re.IGNORECASE)
README_LIMIT = 15_500  # bytes: "about 15 KB"
BLOCK_TIMEOUT_S = 300
WORKERS = 4  # blocks run at once, at most one per core


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    options: tuple[str, ...]
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUNNABLE and "norun" not in self.options


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of one markdown file, in order."""
    found, current, start, body = [], None, 0, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if current is None:
            m = re.match(r"^```(\S*)(.*)$", line)
            if m:
                current, start, body = (m.group(1), tuple(m.group(2).split())), n, []
        elif line.strip() == "```":
            found.append(Block(path, start, current[0], current[1], "\n".join(body) + "\n"))
            current = None
        else:
            body.append(line)
    assert current is None, f"{path.relative_to(REPO)}:{start}: code block never closed"
    return found


ALL = [b for doc in DOCS for b in blocks(doc)]
# docs/architecture.md's backend example runs in tests/test_architecture.py, checked against the
# reference backend there; it is not run a second time here.
ARCHITECTURE_EXAMPLE = readme_backend_example()
RUN = [b for b in ALL if b.runs and b.code != ARCHITECTURE_EXAMPLE]
SKIPPED = [b for b in ALL if b.lang in RUNNABLE and not b.runs]


def test_the_documents_exist():
    for page in PAGES:
        assert (REPO / "docs" / f"{page}.md").is_file(), page
    assert (REPO / "benchmarks" / "README.md").is_file()
    assert RUN, "no block runs"


def test_readme_is_short():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; move detail into docs/"


def test_shell_blocks_are_bash():
    other = [b.id for b in ALL if b.lang in OTHER_SHELLS]
    assert not other, f"fence shell commands as ```bash (or ```bash norun with a reason): {other}"


@pytest.mark.parametrize("block", SKIPPED, ids=lambda b: b.id)
def test_a_block_that_does_not_run_says_why(block):
    first = block.code.splitlines()[0] if block.code.strip() else ""
    assert re.match(r"^# norun: \S.{9,}", first), f"{block.id}: first line must be '# norun: <reason>', got {first!r}"


def _tessera_argv(line: str) -> list[str] | None:
    """The arguments of a ``tessera ...`` or ``torchrun ... -m tessera ...`` command line, else None."""
    words = shlex.split(line, comments=True)
    if words[:1] == ["tessera"]:
        return words[1:]
    if (
        words[:1] == ["torchrun"]
        and "-m" in words
        and words[words.index("-m") + 1 : words.index("-m") + 2] == ["tessera"]
    ):
        return words[words.index("-m") + 2 :]
    return None


@pytest.mark.parametrize("block", [b for b in SKIPPED if b.lang == "bash"], ids=lambda b: b.id)
def test_the_tessera_commands_of_a_block_that_does_not_run_parse(block):
    from tessera.cli.main import _parser

    for line in block.code.splitlines():
        argv = _tessera_argv(line)
        if argv is None:
            continue
        try:
            _parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{block.id}: `{line.strip()}` does not parse")


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"^[a-z]+://|^#|^mailto:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    missing = [t for t in _links(doc) if not (doc.parent / t.split("#", 1)[0]).exists()]
    assert not missing, f"{doc.relative_to(REPO)} links to missing files: {missing}"


def _run(block: Block, where: Path, data: str | None) -> subprocess.CompletedProcess[str]:
    """Run ``block`` in the folder ``where`` with the project's tools first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("PYTHONPATH", None)
    if data is not None:
        env["TESSERA_DATA"] = data
    if block.lang == "bash":
        argv = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    else:
        (where / "block.py").write_text(block.code)
        argv = [sys.executable, str(where / "block.py")]
    return subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """Every runnable block, started at once on as many workers as there are cores (at most
    WORKERS): the blocks are mostly single-threaded start-up, so they overlap well. Maps a block's
    id to its future, or to None where it needs the Planetoid files and they are missing."""
    data = None
    if any(NEEDS_PLANETOID.search(b.code) for b in RUN):
        try:
            data = str(request.getfixturevalue("planetoid_root").parent)
        except pytest.skip.Exception:
            data = None
    pool = ThreadPoolExecutor(max_workers=max(1, min(WORKERS, os.cpu_count() or 1)))
    futures: dict[str, Future | None] = {}
    for b in RUN:
        needs = bool(NEEDS_PLANETOID.search(b.code))
        futures[b.id] = None if needs and data is None else pool.submit(_run, b, tmp_path_factory.mktemp("block"), data)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.id)
def test_block_runs_as_written(block, started):
    future = started[block.id]
    if future is None:
        pytest.skip("Planetoid files not found: set TESSERA_DATA or put them in ../shared/datasets/planetoid")
    run = future.result()
    assert run.returncode == 0, (
        f"{block.id} exited {run.returncode}\n--- block\n{block.code}--- stdout\n{run.stdout[-3000:]}"
        f"--- stderr\n{run.stderr[-3000:]}"
    )
