"""Benchmarks of the engine: sweeps of speculative settings against the target alone (`dflash bench`),
their report, prompt sets and the environment probe; the scripts in benchmarks/ use the same pieces.

    sweep        BenchOptions, run_bench (interleaved rounds), run_with_concurrency
    report       SettingResult, BenchReport (JSON schema: docs/bench-json.md), compare_outputs
    datasets     load_dataset: HumanEval or a prompts file
    environment  versions, CPU model, weight precisions of an IR
"""

from dflash.core.telemetry import openvino_telemetry_off

openvino_telemetry_off()  # before any module of this package imports openvino (core/telemetry.py)
