"""The dflash engine and the pieces every command shares."""

from .telemetry import openvino_telemetry_off

openvino_telemetry_off()  # before any module of this package imports openvino (core/telemetry.py)
