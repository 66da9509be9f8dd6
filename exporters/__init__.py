"""Exporters: Hugging Face targets and DFlash/DSpark drafts to OpenVINO IR."""

from dflash.core.telemetry import openvino_telemetry_off

openvino_telemetry_off()  # before any module of this package imports openvino (core/telemetry.py)
