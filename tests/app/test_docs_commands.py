"""The guides' commands and snippets work when copied.

Every ``flwr run`` command in the README, the quickstart, the method pages, the guides and
``deploy/README.md`` has its ``--run-config`` string parsed by Flower's own parser, merged into the
app's defaults as Flower merges it (a key the app lacks is refused there), and checked by the code the
ServerApp runs before round 1: the run-config validation and the strategy's constructor. A resume
command must continue a run of the same page with settings the checkpoint accepts. Every Python snippet
compiles and runs against stand-ins for the objects a user's project already has (the grid, the
model), so a name it uses without importing fails here. Every repository path a page names, and every
relative link, exists. No Flower processes: the one slow end-to-end test that runs ``flwr run .`` is
``tests/e2e/test_flwr_run.py``.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tomllib
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.common.config import fuse_dicts, parse_config_args

from pollen.app.config import AppConfig, defaults_from_pyproject
from pollen.app.registry import build_strategy
from pollen.core.checkpoint import describe_difference
from pollen.testing.fakes import FakeGrid, full_model_reply, global_arrays_of, model_record, tiny_model

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = defaults_from_pyproject(str(ROOT / "pyproject.toml"))

#: The pages a newcomer copies from.
PAGES = sorted(
    {
        ROOT / "README.md",
        ROOT / "docs" / "quickstart.md",
        *(ROOT / "docs" / "methods").glob("*.md"),
        *(ROOT / "docs" / "guides").glob("*.md"),
        ROOT / "deploy" / "README.md",
    }
)

#: Top-level folders of this repository: a code span starting with one of them names a file or folder of it.
REPO_FOLDERS = ("pollen", "tests", "benchmarks", "deploy", "docs", "tools")
#: Folders of ``deploy/`` that ``deploy/README.md`` names relative to itself.
DEPLOY_FOLDERS = ("scripts", "systemd", "docker")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(page, text.count("\n", 0, m.start()) + 1, m["lang"], textwrap.dedent(m["body"]))
        for m in _FENCE.finditer(text)
    ]


def shell_commands(block: Block) -> list[list[str]]:
    """The block's commands as argument lists, as bash would split them.

    Lines are joined at a trailing backslash (inside quotes too, as bash does), ``NAME="value"`` lines set
    variables that later ``$NAME`` expand to, and ``&&``, ``;``, ``|`` and ``&`` separate commands.
    """
    variables: dict[str, str] = {}
    commands = []
    for line in block.text.replace("\\\n", "").splitlines():
        line = re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m: variables.get(m[1], m[0]), line)
        tokens = shlex.split(line, comments=True)
        if len(tokens) == 1 and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
            name, value = tokens[0].split("=", 1)
            variables[name] = value
            continue
        command: list[str] = []
        for token in [*tokens, ";"]:
            if token in ("&&", "||", ";", "|", "&"):
                while command and (command[0] == "sudo" or re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", command[0])):
                    command.pop(0)  # sudo, environment assignments: the command itself follows
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(token)
    return commands


@dataclass(frozen=True)
class FlwrRun:
    """One ``flwr run`` command of a page."""

    block: Block
    argv: tuple[str, ...]

    def option(self, name: str) -> str | None:
        args = list(self.argv)
        return args[args.index(name) + 1] if name in args else None

    @property
    def overrides(self) -> dict:
        """The ``--run-config`` string as Flower's CLI parses it."""
        value = self.option("--run-config")
        return parse_config_args([value]) if value is not None else {}

    def config(self) -> AppConfig:
        """What the ServerApp validates before round 1: Flower's merge of the overrides into the app's defaults."""
        overrides = self.overrides
        return AppConfig.from_run_config(fuse_dicts(DEFAULTS, overrides), given=set(overrides))


def flwr_runs(page: Path) -> list[FlwrRun]:
    return [
        FlwrRun(block, tuple(argv))
        for block in blocks(page)
        if block.lang in ("bash", "sh")
        for argv in shell_commands(block)
        if argv[:2] == ["flwr", "run"]
    ]


RUNS = [run for page in PAGES for run in flwr_runs(page)]


def test_the_pages_hold_the_commands_this_module_checks() -> None:
    where = {run.block.page.relative_to(ROOT).as_posix() for run in RUNS}
    assert {
        "README.md",
        "docs/quickstart.md",
        "docs/methods/fedopt.md",
        "docs/guides/resume.md",
        "deploy/README.md",
    } <= where
    assert sum(1 for run in RUNS if run.option("--run-config")) >= 8


@pytest.mark.parametrize("run", RUNS, ids=[f"{r.block.where}-{i}" for i, r in enumerate(RUNS)])
def test_every_flwr_run_command_passes_the_checks_before_round_1(run: FlwrRun) -> None:
    assert run.argv[2] == ".", f"{run.block.where}: `flwr run` of another folder than the app's: {run.argv}"
    federation = run.option("--federation-config")
    if federation is not None:
        assert parse_config_args([federation]), f"{run.block.where}: --federation-config {federation!r}"
    try:
        cfg = run.config()
        build_strategy(cfg)
    except ValueError as err:  # ConfigError and a strategy's own refusals are ValueErrors
        pytest.fail(f"{run.block.where}: {' '.join(run.argv)}\n  refused: {err}")


RESUMES = [run for run in RUNS if run.overrides.get("resume")]


def test_the_resume_guide_resumes() -> None:
    assert any(run.block.page.name == "resume.md" for run in RESUMES)


@pytest.mark.parametrize("resume", RESUMES, ids=[r.block.where for r in RESUMES])
def test_a_resume_command_continues_a_run_of_its_page(resume: FlwrRun, tmp_path: Path) -> None:
    """The run it continues (the page's earlier command with that run-name) passes the checkpoint's checks."""
    from pollen.server_app import make_checkpoint

    directory = Path(resume.overrides["resume"]).name
    earlier = [
        run
        for run in flwr_runs(resume.block.page)
        if run.overrides.get("run-name") == directory and not run.overrides.get("resume")
    ]
    assert earlier, f"{resume.block.where}: no command on the page starts the run {directory!r} it resumes"
    first, again = earlier[0].config(), resume.config()
    checkpoint = make_checkpoint(again, tmp_path)  # the ServerApp's own comparison with the checkpoint
    difference = describe_difference(first.as_dict(), checkpoint.fingerprint, ignore=checkpoint.ignore)
    assert difference is None, f"{resume.block.where}: resume refused: {difference}"
    assert build_strategy(first).__class__ is build_strategy(again).__class__
    assert 0 < first["stop-after-round"] < again["num-server-rounds"]


# --------------------------------------------------------------------------- Python snippets
PY_PAGES = [page for page in PAGES if page.parent.name != "results"]
SNIPPETS = [block for page in PY_PAGES for block in blocks(page) if block.lang == "python"]


def _answer(msg: Message) -> Message:
    """Any Flower ClientApp: a trained model (the global one nudged) or evaluation metrics."""
    if msg.metadata.message_type == MessageType.EVALUATE:
        metrics = MetricRecord({"num-examples": 10, "accuracy": 0.5})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
    trained = {name: a + 0.01 if a.dtype == np.float32 else a for name, a in global_arrays_of(msg).items()}
    return full_model_reply(msg, trained)


def _users_objects() -> dict:
    """What the snippets leave to the user's project: a grid of 4 clients, the model, the server's vectors."""
    d = 8
    rng = np.random.default_rng(0)
    return {
        "grid": FakeGrid([1, 2, 3, 4], _answer, client_ids={n: f"client-{n}" for n in (1, 2, 3, 4)}),
        "arrays": model_record(tiny_model()),
        "d": d,
        "x": rng.standard_normal(d).astype(np.float32),
        "delta": rng.standard_normal(d).astype(np.float32),
        "layout": SimpleNamespace(segments=[(0, 5), (5, d)]),
    }


def test_the_pages_hold_the_snippets_this_module_runs() -> None:
    assert {block.page.name for block in SNIPPETS} >= {"README.md", "drop-in.md", "quickstart.md"}


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.where for s in SNIPPETS])
def test_every_python_snippet_runs_with_the_users_own_objects_only(snippet: Block) -> None:
    """A snippet imports every name it uses except the user's objects (``_users_objects``), and runs."""
    code = compile(snippet.text, snippet.where, "exec")
    scope = _users_objects()
    try:
        exec(code, scope)  # noqa: S102 - the documentation's own snippet
    except NameError as err:
        pytest.fail(f"{snippet.where}: {err}: the snippet uses a name it does not import")
    if "result" in scope:  # a strategy's run: it ended with a model of the user's shapes
        assert list(scope["result"].arrays) == list(scope["arrays"])


def test_toml_snippets_parse() -> None:
    for block in (b for page in PAGES for b in blocks(page) if b.lang == "toml"):
        tomllib.loads(block.text)


# --------------------------------------------------------------------------- paths and links
def _named_paths(page: Path) -> list[str]:
    """Repository paths a page names: code spans and code blocks' words that start with a repository folder."""
    text = page.read_text()
    spans = re.findall(r"`([^`\n]+)`", text) + [block.text for block in blocks(page)]
    folders = REPO_FOLDERS + (DEPLOY_FOLDERS if page.parent.name == "deploy" else ())
    pattern = re.compile(rf"(?<![\w./~<$@-])((?:{'|'.join(folders)})/[\w.@/-]*[\w@])")
    named = {match for span in spans for match in pattern.findall(span)}
    # a table of files names a bare script relative to the page
    scripts = set(re.findall(r"^\| `([\w.-]+\.(?:py|sh))` \|", text, flags=re.M))
    return sorted(named | scripts)


def _made_by_the_page(page: Path) -> set[str]:
    """Paths the page's own commands create (``mkdir -p``, a script's ``-o`` folder)."""
    made = set()
    for block in blocks(page):
        if block.lang not in ("bash", "sh"):
            continue
        for argv in shell_commands(block):
            if argv[0] == "mkdir":
                made |= {arg for arg in argv[1:] if not arg.startswith("-")}
            made |= {argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-o"}
    return made


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_repository_path_a_page_names_exists(page: Path) -> None:
    made = _made_by_the_page(page)
    missing = [
        name
        for name in _named_paths(page)
        if not ((page.parent / name).exists() or (ROOT / name).exists())
        and not any(name == m or name.startswith(m.rstrip("/") + "/") for m in made)
    ]
    assert not missing, f"{page.relative_to(ROOT)} names paths that are not in the repository: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_of_a_page_exists(page: Path) -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    targets = [link.split("#")[0] for link in links if not re.match(r"[a-z]+:|#", link)]
    missing = [t for t in targets if t and not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_install_extras_named_by_the_pages_exist() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    for page in PAGES:
        for named in re.findall(r'pip install[^\n]*?"[^"\n]*\[([\w,-]+)\]"', page.read_text()):
            assert set(named.split(",")) <= extras, f"{page.relative_to(ROOT)}: extras {named} (pyproject: {extras})"
