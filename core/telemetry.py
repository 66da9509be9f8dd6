"""OpenVINO's usage telemetry, off in dflash processes (set DFLASH_OPENVINO_TELEMETRY=1 to leave it on).

Unless the user's consent file says otherwise, `import openvino` and every `openvino.convert_model`
report to Google Analytics from a worker thread that forks a process for each request. With no network
(CI runners, air-gapped servers, this project's machines) the process waits for those children at exit,
and a fork taken while another thread holds Python's import lock deadlocks for good: `dflash export`
was seen hanging after SIGINT, its telemetry child stuck in `_ModuleLock.acquire`. Every dflash package
calls `openvino_telemetry_off()` in its `__init__`, before any of its modules imports openvino. Nothing
here imports openvino.
"""

from __future__ import annotations

import os

KEEP_ENV = "DFLASH_OPENVINO_TELEMETRY"


def openvino_telemetry_off() -> None:
    """Decline consent for this process (idempotent); an instance already made is switched off too."""
    if os.environ.get(KEEP_ENV) == "1":
        return
    try:
        import openvino_telemetry
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    except ImportError:  # not installed, or another layout: nothing to turn off
        return
    OptInChecker.check = lambda self, *args, **kwargs: ConsentCheckResult.DECLINED
    instance = getattr(openvino_telemetry.Telemetry, "_SingletonMetaClass__single_instance", None)
    if instance is not None:
        instance.consent = False
