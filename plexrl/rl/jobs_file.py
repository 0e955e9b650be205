"""`plexrl run JOBS.yaml`: run the jobs a YAML file describes, together on one local cluster.

    cluster: {devices: 2, policy: plexrl}        # optional
    jobs:
      - {name: add, algorithm: grpo, task: addition, steps: 20, seed: 1}

The file is validated with pydantic before anything runs; every bad field is reported as
`jobs[0].steps = 0: expected greater than or equal to 1`, one line each, with no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from plexrl import engines
from plexrl.observe.web import add_metrics_port, watched
from plexrl.policy import Policy
from plexrl.rl.spec import JobSpec, describe_errors
from plexrl.rl.train import controllers, run_job
from plexrl.rl.warm_start import warm_model

MiB = 1 << 20


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    devices: int = Field(2, ge=1, le=64)
    policy: str = Field("plexrl", description="scheduling policy: plexrl, fcfs, sjf or hrrn")
    device_memory_mb: int = Field(256, ge=1)
    host_memory_mb: int = Field(2048, ge=1)

    @field_validator("policy")
    @classmethod
    def known_policy(cls, value: str) -> str:
        return Policy.parse(value).value


class JobsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    jobs: list[JobSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def unique_names(self) -> "JobsFile":
        names = [job.name for job in self.jobs]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"job names {repeated} appear more than once (expected unique names)")
        return self


class JobsFileError(Exception):
    """A jobs file that cannot be run; the message lists every problem."""


def load(path: str | Path) -> JobsFile:
    path = Path(path)
    if not path.is_file():
        raise JobsFileError(f"{path}: no such file (expected a YAML jobs file)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise JobsFileError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise JobsFileError(f"{path}: got a {type(raw).__name__} at the top level (expected a mapping with 'jobs:')")
    try:
        return JobsFile.model_validate(raw)
    except ValidationError as error:
        raise JobsFileError("\n".join([f"{path}: {len(error.errors())} problem(s)"] + describe_errors(error))) from None


def run(spec: JobsFile, on_step=None, engine: str = "process", device: str = "auto", precision: str = "auto",
        metrics_port: int | None = None) -> dict:
    models = {job.name: str(warm_model(job.task, job.model)) for job in spec.jobs}
    teachers = {job.name: str(warm_model(job.task, job.model, steps=job.teacher_warm_start_steps))
                for job in spec.jobs if job.algorithm == "distill"}
    c = spec.cluster
    with engines.session(engine, c.devices), engines.open_cluster(
            engine, c.devices, policy=c.policy, device_memory_bytes=c.device_memory_mb * MiB,
            host_memory_bytes=c.host_memory_mb * MiB, torch_device=device, precision=precision) as cluster, \
            watched(cluster, metrics_port):
        with controllers(len(spec.jobs)) as pool:
            futures = [pool.submit(run_job, cluster, job, models[job.name], teachers.get(job.name), on_step)
                       for job in spec.jobs]
            results = [future.result() for future in futures]
        metrics = cluster.metrics()
    return {"jobs": [{"name": r.name, "algorithm": r.algorithm, "steps": len(r.rewards), "rewards": r.rewards,
                      "wall_s": r.wall_s, "consumed_device_s": metrics["jobs"].get(r.name, {}).get("consumed_device_s", 0.0)}
                     for r in results],
            "switches": metrics["switches"], "device_busy_s": metrics["device_busy_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plexrl run", description="Run the jobs described in a YAML file.")
    parser.add_argument("jobs_file", help="YAML file with 'jobs:' (and optionally 'cluster:')")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the results")
    parser.add_argument("--check", action="store_true", help="validate the file and exit")
    add_metrics_port(parser)
    engines.add_engine_option(parser)
    args = parser.parse_args(argv)
    try:
        spec = load(args.jobs_file)
    except JobsFileError as error:
        print(f"plexrl run: {error}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.jobs_file}: {len(spec.jobs)} job(s), valid")
        return 0
    report = None if args.json else (lambda job, step, stats: print(f"{job} step {step}: reward {stats.reward:.3f}", flush=True))
    summary = run(spec, on_step=report, engine=args.engine, device=args.device, precision=args.precision,
                  metrics_port=args.metrics_port)
    if args.json:
        print(json.dumps(summary))
    else:
        for job in summary["jobs"]:
            print(f"{job['name']} ({job['algorithm']}): reward {job['rewards'][0]:.3f} -> {job['rewards'][-1]:.3f} "
                  f"over {job['steps']} steps, {job['consumed_device_s']:.1f} device-s")
    return 0
