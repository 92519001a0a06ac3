"""pollen's own ClientApp takes the client-side DP path (issue 39): local DP without a codec sends a dense, noised
update built straight from its flat update (``compress_update``). Not a ``flower_compat`` module: it trains pollen's
model (torch) on the installed Fashion-MNIST; the glue itself is tested in ``test_privacy_client_mod.py``.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message

from pollen.clientside.compression_mod import dp_request, upload_noise_generator
from pollen.compression import decode_payload
from pollen.privacy.mechanisms import clip_l2, gaussian_noise, l2_norm
from pollen.testing.fakes import train_message
from pollen.wire import protocol
from pollen.wire.records import records_to_payload


def decoded(records, dim: int) -> np.ndarray:  # noqa: ANN001
    payload = records_to_payload(records[protocol.UPDATE_RECORD], records[protocol.UPDATE_META_RECORD])
    return decode_payload(payload, dim)


def test_pollens_clientapp_sends_a_local_dp_update_without_a_codec():
    """pollen's own ClientApp (compress_update straight from its flat update) takes the same DP path."""
    from pathlib import Path

    from flwr.app import Context, RecordDict

    import pollen.client_app as client_app
    from pollen.app.config import AppConfig, defaults_from_pyproject
    from pollen.app.experiment import build_model

    root = Path(__file__).resolve().parents[2]
    run_config = {
        **defaults_from_pyproject(str(root / "pyproject.toml")),
        "model": "mlp",
        "batch-size": 16,
        "local-steps": 2,
        "partitioner": "iid",
    }
    model = build_model(AppConfig.from_run_config(run_config, check_strategy=False))
    start = OrderedDict((k, v.detach().numpy().copy()) for k, v in model.state_dict().items())
    dim = sum(v.size for v in start.values())
    config = {
        protocol.CFG_SERVER_ROUND: 1,
        protocol.CFG_DP_MODE: "local",
        protocol.CFG_DP_CLIP: 0.05,
        protocol.CFG_DP_NOISE: 1.0,
        protocol.CFG_DP_SEED: 1,
    }

    def reply_for(cfg: dict) -> Message:
        context = Context(
            run_id=1,
            node_id=1,
            node_config={"partition-id": 0, "num-partitions": 4},
            state=RecordDict(),
            run_config=run_config,
        )
        return client_app.app(train_message(start, cfg, node_id=1), context)

    reply = reply_for(config)
    assert not reply.has_error(), reply.error.reason
    assert protocol.ARRAYS_RECORD not in reply.content.array_records
    sent = decoded(reply.content, dim)
    plain = reply_for({protocol.CFG_SERVER_ROUND: 1})  # the same training without DP: the full model
    trained = np.concatenate([np.asarray(v).ravel() for v in plain.content.array_records["arrays"].to_numpy_ndarrays()])
    delta = (trained - np.concatenate([v.ravel() for v in start.values()])).astype(np.float32)
    dp = dp_request(ConfigRecord(config))
    noise = gaussian_noise(dim, 1.0 * 0.05, upload_noise_generator(dp, config, "partition-0"))
    np.testing.assert_allclose(sent - noise, clip_l2(delta, 0.05)[0], atol=1e-6)
    assert l2_norm(sent - noise) <= 0.05 * (1 + 1e-4)


def test_pollens_clientapp_refuses_local_dp_for_a_step_that_uploads_other_vectors():
    """Fed-LAMB's statistics (extras) are data-dependent vectors local DP does not noise: refused, not sent."""
    from types import SimpleNamespace

    import pollen.client_app as client_app
    from pollen.clientside.steps import StepOutcome

    config = ConfigRecord({protocol.CFG_DP_MODE: "local", protocol.CFG_DP_CLIP: 1.0, protocol.CFG_DP_NOISE: 1.0})
    outcome = StepOutcome({"num-steps": 1}, extras={"v": np.ones(3, dtype=np.float32)}, upload_model=False)
    with pytest.raises(ValueError, match=r"also uploads \['v'\], which would leave the node un-noised") as err:
        client_app._reply_records(SimpleNamespace(config=config), outcome, None, None)
    assert str(err.value).startswith(protocol.SETUP_ERROR_PREFIX)
