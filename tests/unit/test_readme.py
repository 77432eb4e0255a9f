"""The README's commands work, and the docs point at things that exist.

Every command line in the README's fenced code blocks is checked without training anything:
``posttrain <command> ...`` (also as ``python -m posttrain`` or under ``torchrun ... -m posttrain``) must
parse with the CLI's own parser, ``python -m posttrain <command> --help`` must succeed, and the config it
names must load with the command's schema, overrides included (a pipeline loads each of its stages as
``posttrain pipeline`` does before training). ``make TARGET`` needs the target in the Makefile. Any
other command form in a README code block fails the test: cover it here, or leave it out of the README.
The docs' ``posttrain`` lines get the same checks (synopsis lines with placeholders only the command name).
Also: the README has at most 200 lines, every relative link in README.md and docs/*.md resolves (file,
and heading for ``#anchor``), and every backticked ``configs/``, ``scripts/``, ``benchmarks/``, ``tests/``
path exists.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 200
NOT_COMMANDS = {"text", "yaml", "python", "json"}  # output, config and code samples, not shell commands


def code_blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of each fenced block."""
    blocks, current = [], None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(\S*)\s*$", line)
        if fence and current is None:
            current = (fence.group(1).lower(), n + 1, [])
        elif line.strip() == "```" and current is not None:
            blocks.append(current)
            current = None
        elif current is not None:
            current[2].append(line)
    assert current is None, f"{path.name}: unclosed code block from line {current[1]}"
    return blocks


def command_lines(path: Path) -> list[tuple[str, int, list[str]]]:
    """(where, line number, shell tokens) of each command in the shell blocks, comments dropped and
    backslash continuations joined."""
    out = []
    for lang, first, lines in code_blocks(path):
        if lang in NOT_COMMANDS:
            continue
        buffer, start = "", None
        for i, line in enumerate(lines):
            if start is None:
                start = first + i
            if line.rstrip().endswith("\\"):
                buffer += line.rstrip()[:-1] + " "
                continue
            tokens = shlex.split(buffer + line, comments=True)
            if tokens:
                out.append((f"{path.name}:{start}", start, tokens))
            buffer, start = "", None
    return out


def posttrain_args(tokens: list[str]) -> list[str] | None:
    """The arguments after ``posttrain`` / ``python -m posttrain`` / ``torchrun ... -m posttrain``."""
    if tokens[0] == "posttrain":
        return tokens[1:]
    if tokens[0] in ("python", "python3", "torchrun") and "-m" in tokens:
        i = tokens.index("-m")
        if i + 1 < len(tokens) and tokens[i + 1] == "posttrain":
            return tokens[i + 2:]
    return None


@functools.lru_cache(maxsize=None)
def help_exit_code(command: str) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-m", "posttrain", command, "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr[-2000:]


def check_posttrain(where: str, args: list[str]) -> None:
    """Parse ``args`` with the CLI's parser and load what the command would load, without running it."""
    from posttrain.cli import build_parser
    from posttrain.stages import STAGES, get_stage
    from pretrain.config import load_config

    assert args, f"{where}: `posttrain` without a command"
    try:
        parsed = build_parser().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{where}: `posttrain {' '.join(args)}` does not parse (exit {e.code})")
    code, err = help_exit_code(parsed.command)
    assert code == 0, f"{where}: `python -m posttrain {parsed.command} --help` exited {code}: {err}"

    if parsed.command in STAGES:
        schema, _ = get_stage(parsed.command)
        load_config(schema, parsed.config, list(parsed.overrides))
    elif parsed.command == "pipeline":
        from posttrain.pipeline import PipelineConfig, plan

        cfg = load_config(PipelineConfig, parsed.config, list(parsed.overrides))
        assert cfg.stages, f"{where}: {parsed.config} has no stages"
        plan(cfg)  # as run_pipeline validates every stage before training
    elif parsed.command == "sweep":
        from posttrain.tools.sweep_config import SweepConfig, arm_config

        cfg = load_config(SweepConfig, parsed.config, list(parsed.overrides))
        tasks, arms = cfg.selected()
        for task in tasks:  # as run_sweep loads every arm's config before training
            for arm in arms:
                arm_config(cfg, task, arm, cfg.seeds[0])
    elif parsed.command == "serve-reward":
        from posttrain.tools.serve_reward import load_reward

        load_reward(parsed.config)
    elif parsed.command == "eval":
        from posttrain.eval.evaluate import EvalConfig
        from pretrain.config import validate

        validate(EvalConfig(rewards=parsed.rewards, prompts=parsed.prompts, num_prompts=parsed.num_prompts,
                            samples_per_prompt=parsed.samples_per_prompt, seed=parsed.seed,
                            num_inference_steps=parsed.steps, guidance_scale=parsed.guidance_scale), "--")
        if parsed.prompts not in ("heldout", "train"):
            assert (ROOT / parsed.prompts).is_file(), f"{where}: prompt file {parsed.prompts} not found"
    elif parsed.command in ("sample", "doctor"):
        pass  # a model folder from an earlier command / the ranks of a launch: the arguments parsed above
    else:
        pytest.fail(f"{where}: no check for `posttrain {parsed.command}`: add one to {Path(__file__).name}")


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)}


README_COMMANDS = command_lines(README)


def test_readme_has_commands_and_fits():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    firsts = {tuple(t[:2]) for _, _, t in README_COMMANDS}
    assert ("make", "quickstart") in firsts and ("make", "test") in firsts


@pytest.mark.parametrize("where,tokens", [(w, t) for w, _, t in README_COMMANDS],
                         ids=[w for w, _, _ in README_COMMANDS])
def test_readme_command(where, tokens, monkeypatch):
    monkeypatch.chdir(ROOT)  # configs are named relative to the repository root
    if tokens[0] == "make":
        missing = set(tokens[1:]) - make_targets()
        assert len(tokens) > 1 and not missing, f"{where}: no Makefile target {sorted(missing)}"
        return
    args = posttrain_args(tokens)
    if args is None:
        pytest.fail(f"{where}: unknown command form `{' '.join(tokens)}`; cover it in {Path(__file__).name} "
                    "or keep it out of the README")
    check_posttrain(where, args)


def _is_synopsis(args: list[str]) -> bool:
    """A usage line such as `posttrain grpo CONFIG [key.path=value ...]`: placeholders, not values."""
    return any(a.startswith("[") or re.fullmatch(r"[A-Z][A-Z_]+", a) for a in args[1:])


DOC_COMMANDS = [(w, t) for d in DOCS for w, _, t in command_lines(d) if posttrain_args(t) is not None]


@pytest.mark.parametrize("where,tokens", DOC_COMMANDS, ids=[w for w, _ in DOC_COMMANDS])
def test_docs_posttrain_command(where, tokens, monkeypatch):
    from posttrain.cli import build_parser

    monkeypatch.chdir(ROOT)
    args = posttrain_args(tokens)
    if _is_synopsis(args):
        known = build_parser()._subparsers._group_actions[0].choices
        assert args and args[0] in known, f"{where}: unknown command `posttrain {args[0] if args else ''}`"
    else:
        check_posttrain(where, args)


def _slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    bad = []
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not bad, f"{page.name}: broken links: {bad}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_repository_paths_exist(page):
    missing = [p for p in re.findall(r"`((?:configs|scripts|benchmarks|tests|docs)/[^`\s*<>]+)`", page.read_text())
               if not (ROOT / p).exists()]
    assert not missing, f"{page.name}: paths that do not exist: {missing}"
