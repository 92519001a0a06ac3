"""TensorBoard: one event-file directory per run, a scalar per results column, the run-config as hyper-parameters.

Written with PyTorch's ``SummaryWriter`` (it needs the ``tensorboard`` package: ``pip install
"flwr-pollen[tensorboard]"``), imported only when this tracker is chosen. Each round's scalars are flushed
at once, so TensorBoard shows a run as it goes. The hyper-parameters go into the run's own directory (not
the sub-directory ``SummaryWriter.add_hparams`` makes), so the HPARAMS tab lists each run once, next to its
scalars. A resumed run continues in the same directory; events written after the checkpoint's round (a run
that crashed later) are purged by TensorBoard's reader, as ``purge_step`` asks.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pollen.app.trackers.base import FAILED, FINISHED, hyperparameters

#: The scalars the HPARAMS tab shows next to each run's hyper-parameters.
HPARAM_METRICS = ("accuracy", "loss", "cum_uplink_bytes", "cum_downlink_bytes", "elapsed_seconds")


class TensorBoardTracker:
    """Event files under ``log_dir`` (a run's own directory: ``<tracker-dir>/<run-name>``)."""

    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.writer: Any = None

    def where(self) -> str:
        return str(self.log_dir)

    def start(self, config: Mapping[str, Any], *, resume_at: int | None = None) -> bool:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        continued = resume_at is not None and any(self.log_dir.glob("events.out.tfevents.*"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=resume_at)
        experiment, session_start, _ = hparams(hyperparameters(config), dict.fromkeys(HPARAM_METRICS, 0.0))
        self.writer.file_writer.add_summary(experiment)
        self.writer.file_writer.add_summary(session_start)
        self.writer.flush()
        return continued

    def log_round(self, step: int, metrics: Mapping[str, float]) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def finish(self, status: str) -> None:
        if self.writer is None:
            return
        if status in (FINISHED, FAILED):  # a stopped run (stop-after-round) is not over: it resumes later
            self.writer.file_writer.add_summary(_session_end(status))
        self.writer.close()
        self.writer = None


def _session_end(status: str) -> Any:
    """The hparams plugin's session-end summary, success or failure (``hparams()`` only writes success)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams.api_pb2 import Status
    from tensorboard.plugins.hparams.metadata import PLUGIN_DATA_VERSION, PLUGIN_NAME, SESSION_END_INFO_TAG
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionEndInfo

    code = Status.STATUS_SUCCESS if status == FINISHED else Status.STATUS_FAILURE
    content = HParamsPluginData(session_end_info=SessionEndInfo(status=code), version=PLUGIN_DATA_VERSION)
    metadata = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=content.SerializeToString())
    )
    return Summary(value=[Summary.Value(tag=SESSION_END_INFO_TAG, metadata=metadata)])
