"""The vLLM worker extension of the collective weight push (``engine.worker_extension_cls``).

vLLM imports this class in every worker process before it loads the model, which registers the
``rollpacker`` weight-transfer backend there (``weight_transfer.register``); its one method hands
the last push's report back through ``collective_rpc``.
"""

from __future__ import annotations

from rollpacker.engines.weight_transfer import register

register()


class PushReportExtension:
    def rollpacker_push_report(self) -> str:
        """The worker's last push (``PushReport`` as JSON; empty before the first push)."""
        engine = getattr(self, "weight_transfer_engine", None)
        report = getattr(engine, "report", None)
        return report.to_json() if report is not None else ""
