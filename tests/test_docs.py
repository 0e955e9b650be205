"""The docs site builds with no warning, and its reference names everything the code offers.

`mkdocs build --strict` (what `make docs` runs) fails on a broken link or a reference that no longer
resolves. The lists checked against the built reference come from the code, not from the docs'
generator: every flag of every command's parser, every `ClusterConfig` field, every key of a real
cluster's `metrics()`. A new flag, setting or metric that the reference does not show fails here.
The README stays short: at most 150 lines, none over 120 characters outside code blocks and tables.
"""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _hook():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def page_text(site: Path, page: str) -> str:
    """A built page's text, tags dropped and entities decoded, so `--flag` is searched as written."""
    raw = (site / page / "index.html").read_text()
    return html.unescape(re.sub(r"<[^>]+>", "", raw))


def test_docs_build_strict_and_every_page_is_built(site):
    for page in ("concepts/jobs", "guides/serve", "reference/cli", "reference/config", "reference/metrics",
                 "reference/errors", "reference/schemas", "reference/api", "design", "benchmarks"):
        assert (site / page / "index.html").is_file(), page


def sections(site: Path, page: str) -> dict[str, str]:
    """A built page's h3 sections by the text of their heading (`plexrl sim calibrate`)."""
    raw = (site / page / "index.html").read_text()
    out = {}
    for part in raw.split("<h3")[1:]:
        heading, _, body = part.partition("</h3>")
        name = html.unescape(re.sub(r"<[^>]+>", "", heading.split(">", 1)[1])).replace("¶", "").strip()
        out[name] = html.unescape(re.sub(r"<[^>]+>", "", body.split("<h2")[0]))
    return out


def test_cli_reference_names_every_flag_of_every_command(site):
    from plexrl import bench, cli

    parsers = _hook().parsers()
    expected = {f"plexrl {n}" for n in cli.COMMANDS if n != "bench"} | {f"plexrl bench {n}" for n in bench.BENCHES}
    assert expected | {"plexrl sim calibrate"} == set(parsers)
    documented = sections(site, "reference/cli")
    missing = []
    for command, parser in parsers.items():
        section = documented.get(command, "")
        for action in parser._actions:
            for name in action.option_strings or [action.dest]:
                if name not in ("-h", "--help") and not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", section):
                    missing.append(f"{command} {name}")
    assert not missing, f"flags missing from docs/reference/cli.md: {missing}"


def test_config_reference_names_every_field_with_its_meaning(site):
    from plexrl.runtime.config import ClusterConfig

    text = page_text(site, "reference/config")
    meanings = _hook().field_comments(ClusterConfig)
    for field in dataclasses.fields(ClusterConfig):
        assert field.name in text, field.name
        assert meanings.get(field.name), f"ClusterConfig.{field.name} has no comment saying what it means"


def metrics_keys(metrics: dict) -> set[str]:
    """Every key of a metrics() dict, below the levels keyed by a job, device, state or model name."""
    named = {"jobs", "placement", "admission", "device_budget", "device_busy_s_per_device", "residency",
             "activation_reserves", "queued"}
    keys: set[str] = set()

    def visit(d: dict, by_name: bool):
        for key, value in d.items():
            if not by_name:
                keys.add(str(key))
            if isinstance(value, dict):
                visit(value, not by_name and key in named)

    visit(metrics, False)
    return keys


def test_metrics_reference_names_every_key_of_a_real_cluster(site, tiny_model):
    import plexrl
    from tests.helpers import datum

    with plexrl.LocalCluster(devices=2, device_memory_bytes=16 * MiB, host_memory_bytes=128 * MiB) as cluster:
        service = cluster.service_client(job="job-a")
        trainer = service.create_training_client(base_model=tiny_model, seed=0)
        trainer.forward_backward([datum([5, 6, 7, 8])], loss_fn="cross_entropy")
        trainer.optim_step(plexrl.AdamParams(learning_rate=1e-3)).result()
        sampler = trainer.save_weights_and_get_sampling_client()
        sampler.sample(prompt=plexrl.ModelInput.from_ints([5, 6]), num_samples=2,
                       sampling_params=plexrl.SamplingParams(max_tokens=3, seed=1)).result()
        service.report_step(1)
        keys = metrics_keys(cluster.metrics())
    from plexrl.policy.types import TransitionKind

    keys |= {kind.value for kind in TransitionKind}  # `transitions` counts each kind that happened
    text = page_text(site, "reference/metrics")
    missing = sorted(key for key in keys if not re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", text))
    assert not missing, f"metrics() keys missing from docs/reference/metrics.md: {missing}"


def test_errors_reference_names_every_exception(site):
    from plexrl import errors

    text = page_text(site, "reference/errors")
    assert all(name in text for name in errors.__all__)
    undocumented = [name for name in errors.__all__ if not getattr(errors, name).__doc__]
    assert not undocumented, f"exceptions without a docstring saying when they are raised: {undocumented}"


def _prose_lines(path: Path):
    """Lines outside fenced code blocks and tables."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.lstrip().startswith("|"):
            yield number, line


def test_readme_is_short_and_keeps_the_setup_commands():
    readme = ROOT / "README.md"
    text = readme.read_text()
    assert len(text.splitlines()) <= 150
    assert "make demo" in text and "make test" in text


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_prose_line_over_120_characters(path):
    long = [number for number, line in _prose_lines(path) if len(line) > 120]
    assert not long, f"{path.relative_to(ROOT)}: lines over 120 characters: {long}"


def test_every_design_reference_in_the_code_names_a_section_of_the_design_page():
    design = (ROOT / "docs" / "design.md").read_text()
    sections = {m.group(1): m.start() for m in re.finditer(r"^## (\d+)\. ", design, re.MULTILINE)}
    cited = set()
    for path in [*(ROOT / "plexrl").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        cited |= {(path.name, ref) for ref in re.findall(r"docs/design\.md §(\d+(?:\.\d+)?)", path.read_text())}
    assert cited
    for where, ref in sorted(cited):
        section, _, item = ref.partition(".")
        assert section in sections, f"{where} cites docs/design.md §{ref}: no such section"
        if item:
            body = design[sections[section]:].split("\n## ", 1)[0]
            assert re.search(rf"^{item}\. ", body, re.MULTILINE), f"{where} cites §{ref}: no item {item}"


def test_the_readme_library_example_runs(tmp_path):
    """The README's first Python example, as written, on the local engine (same API, no processes)."""
    code = (ROOT / "README.md").read_text().split("```python", 1)[1].split("```", 1)[0]
    assert "plexrl.ProcessCluster(" in code and "/tmp/models/tiny/m" in code
    code = code.replace("plexrl.ProcessCluster(", "plexrl.LocalCluster(").replace(
        "/tmp/models/tiny/m", str(tmp_path / "models" / "tiny" / "m"))
    exec(compile(code, "README.md", "exec"), {})
