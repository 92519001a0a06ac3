"""Names of the records and config entries that pollen's server and clients exchange.

One place for the wire vocabulary, so the strategies, the client-side mods and the
ClientApp cannot drift apart. Flower-free (plain strings).

A train message from a pollen strategy carries the usual Flower pair
``{"arrays": ArrayRecord (global model), "config": ConfigRecord}``; the config may
ask the client to upload a compressed update instead of its full model. A reply is
either Flower's ordinary ``{"arrays": full local model, "metrics": ...}`` (what any
existing ClientApp sends) or pollen's compressed form:

- ``UPDATE_RECORD``: ArrayRecord holding the codec's payload arrays,
- ``UPDATE_META_RECORD``: ConfigRecord with the codec name and dimension,
- ``BUFFERS_RECORD``: ArrayRecord with the non-trainable arrays, uncompressed,
- ``"metrics"``: MetricRecord with at least ``num-examples``.

Methods that move more than the model add named extras, in either direction: each extra vector
travels in its own ArrayRecord ``pollen.x.<name>`` holding one array ``"value"`` (so its bytes are
counted under its own name), and one-bit flags travel as booleans in the ConfigRecord
``pollen.flags``. A round with more than one exchange sends its later messages with the message type
``train.pollen_phase`` and the phase name in the config (``pollen.phase``).
"""

ARRAYS_RECORD = "arrays"
CONFIG_RECORD = "config"
METRICS_RECORD = "metrics"

UPDATE_RECORD = "pollen.update"
UPDATE_META_RECORD = "pollen.update-meta"
BUFFERS_RECORD = "pollen.buffers"
IDENTITY_RECORD = "pollen.identity"
CLIENT_INFO_RECORD = "pollen.client-info"
CLIENT_STATE_PREFIX = "pollen."
FLAGS_RECORD = "pollen.flags"
EXTRA_RECORD_PREFIX = "pollen.x."
EXTRA_ARRAY = "value"

# Message type of a mid-round exchange (a second, third... message of one training round); the
# ClientApp routes it with ``@app.train("pollen_phase")`` and dispatches on CFG_PHASE.
PHASE_MESSAGE_TYPE = "train.pollen_phase"

# A pollen client piece that finds the ClientApp set up so that it can never answer (a mod order that cannot
# work) raises an exception whose text starts with this; the server stops the run on the first such reply.
SETUP_ERROR_PREFIX = "pollen setup error: "

# ConfigRecord keys sent by the server in a train message.
CFG_SERVER_ROUND = "server-round"
CFG_CODEC = "pollen.codec"
CFG_TOPK_RATIO = "pollen.topk-ratio"
CFG_ERROR_FEEDBACK = "pollen.error-feedback"
# What the server applied of this client's last upload (error-fed uploads): the round (0: none yet) and
# the fraction of it (1.0 unless the outlier screen clipped it). The client owes the rest to its residual.
CFG_APPLIED_ROUND = "pollen.applied-round"
CFG_APPLIED_SCALE = "pollen.applied-scale"
#: The round of the client's last upload the server refused for its content (the outlier screen, validation):
#: an error-fed client drops that upload and its residual instead of owing them (it would send them again).
CFG_REFUSED_ROUND = "pollen.refused-round"
CFG_GRANULARITY = "pollen.granularity"
# Differential privacy of the upload (privacy spec §4, §6; pollen.privacy.mechanisms, clientside.compression_mod).
# "central": a trusted server; the client clips its upload, the server re-clips, sums and noises once per release.
# "local": no trusted server; the client clips AND noises every upload. Absent: no client-side DP.
CFG_DP_MODE = "pollen.dp.mode"
# The L2 clip norm C (float > 0) of the whole upload: all trainable tensors jointly, in update units
# (Delta = x_local - x_global; with error feedback, of Delta + e), clipped before compression.
CFG_DP_CLIP = "pollen.dp.clip"
# z (float > 0; local mode only): the client adds N(0, (z*C)^2) to every coordinate, fresh for every upload.
CFG_DP_NOISE = "pollen.dp.noise-multiplier"
# Optional, for reproducible SIMULATIONS only (int >= 0): the local noise comes from a Philox generator keyed from
# (seed, client id, server round, message index), so anyone who knows the seed can remove it: never in deployment.
# Absent: each upload's noise generator gets a fresh unpredictable 128-bit key from the OS (secrets).
CFG_DP_SEED = "pollen.dp.seed"
CFG_BUFFER_KEYS = "pollen.buffer-keys"
CFG_PHASE = "pollen.phase"
CFG_PHASE_INDEX = "pollen.phase-index"
CFG_LOCAL_STEP = "pollen.local-step"
CFG_RUN_KEY = "pollen.run-key"
# The server session: a token of the ServerApp process (a run, or one resume of it). A client's state file records
# it with each snapshot, so a late commit (a message that timed out while the client went on) never overwrites a
# later round of the same session, while a resumed run's commits replace what the crashed run wrote after its
# checkpoint.
CFG_SESSION = "pollen.session"
CFG_PARTITION = "pollen.partition"  # population mode: the partition (client) the receiving node plays for this message
CFG_GIVEN_KEYS = "pollen.given-keys"  # run-config keys the user set over a preset (the ClientApp resolves it alike)
# The Fed-LAMB family's train config (pollen.strategies.fedlamb <-> pollen.clientside.steps.fedlamb).
CFG_VHAT_VERSION = "pollen.v-hat-version"
# Whether the client keeps v_hat in its state: false when the server sends it with every message (one sync a
# round), so the client's state does not carry a d-vector it never reads (Flower ships the state with each message).
CFG_VHAT_KEEP = "pollen.v-hat-keep"
CFG_SYNC = "pollen.sync"
CFG_STAT = "pollen.stat"
CFG_TRUST_RATIO = "pollen.trust-ratio"
# The local step divides by sqrt(max(v_hat, local v)) this round (v_hat is still its initial eps; the
# authors' round-1 reading, run-config round1-denominator = "local-v").
CFG_LOCAL_VHAT = "pollen.local-vhat"
CFG_BETA_1 = "pollen.beta-1"
CFG_BETA_2 = "pollen.beta-2"
CFG_EPS = "pollen.eps"
ADAPTIVE_LOCAL_STEP = "adaptive-local"
# HA-Fed: the local step, the gossip phase and their settings
GOSSIP_LOCAL_STEP = "hafed-local"
GOSSIP_PHASE = "hafed-gossip"
CFG_GOSSIP_TAU = "pollen.gossip.tau"
CFG_GOSSIP_EVERY = "pollen.gossip.every"
CFG_GOSSIP_ACTIVE = "pollen.gossip.active-prob"
CFG_GOSSIP_SEGMENT = "pollen.gossip.segment"
# Secure aggregation (pollen.secagg, pollen.clientside.secagg_mod): a train message's setup, the three phases.
CFG_SECAGG_NEIGHBOURS = "pollen.secagg.neighbours"
CFG_SECAGG_THRESHOLD = "pollen.secagg.threshold"
CFG_SECAGG_CLIP = "pollen.secagg.clip"
CFG_SECAGG_BITS = "pollen.secagg.bits"
CFG_SECAGG_MAX_CLIENTS = "pollen.secagg.max-clients"
CFG_SECAGG_DIM = "pollen.secagg.dim"
CFG_SECAGG_ROUND = "pollen.secagg.round"
CFG_SECAGG_SEED = "pollen.secagg.seed"
CFG_SECAGG_OFF = "pollen.secagg.off"  # a round too small to aggregate securely: the client trains and sends nothing
SECAGG_RECORD = "pollen.secagg"
SECAGG_ROUND_ENTRY = "round"  # each phase message's round key: a client refuses one of another round
SECAGG_SHARE_PHASE = "secagg-share-keys"
SECAGG_MASKED_PHASE = "secagg-masked-input"
SECAGG_UNMASK_PHASE = "secagg-unmask"
SECAGG_PHASES = (SECAGG_SHARE_PHASE, SECAGG_MASKED_PHASE, SECAGG_UNMASK_PHASE)
# The lazy / bidirectional family (pollen.strategies.lazy <-> pollen.clientside.lazy_mod).
CFG_LAZY_UP_RULE = "pollen.lazy.up-rule"  # none | nla | aa; its presence marks a lazy-family message
CFG_LAZY_UP_TAU = "pollen.lazy.up-tau"
CFG_LAZY_UP_CODEC = "pollen.lazy.up-codec"
CFG_LAZY_UP_TOPK = "pollen.lazy.up-topk"
CFG_LAZY_EF_MODE = "pollen.lazy.ef-mode"
CFG_LAZY_REF_SUM = "pollen.lazy.ref-sum"  # checksum of the server's copy of the client's last upload
CFG_LAZY_DOWN = "pollen.lazy.down"  # dense | full | send | skip | aa | keep
CFG_LAZY_APPLY = "pollen.lazy.apply"  # add | set
CFG_LAZY_X_SUM = "pollen.lazy.x-sum"  # checksum of the client's model after applying the downlink
DOWN_RECORD = "pollen.down"
DOWN_META_RECORD = "pollen.down-meta"
DOWN_BUFFERS_RECORD = "pollen.down-buffers"
FLAG_SKIP = "lazy-skip"
FLAG_AA = "lazy-aa"
FLAG_RESYNC = "lazy-resync"

# Keys of UPDATE_META_RECORD.
META_CODEC = "codec"
META_DIM = "dim"
META_GRANULARITY = "granularity"

# Keys of IDENTITY_RECORD / the identify query.
QUERY_IDENTIFY = "query.pollen_identify"
IDENTITY_CLIENT_ID = "client-id"
IDENTITY_CLUSTER_ID = "cluster-id"

NUM_EXAMPLES = "num-examples"


def partition_client_id(partition: int) -> str:
    """The client id of partition ``partition`` (a simulated node's own id, and a played client's)."""
    return f"partition-{int(partition)}"


def partition_of_client_id(client_id: str) -> int | None:
    """The partition of a ``partition-<i>`` client id (:func:`partition_client_id`), else ``None``."""
    number = client_id.removeprefix("partition-")
    return int(number) if number != client_id and number.isdigit() else None


def extra_record(name: str) -> str:
    """Record name of the extra vector ``name`` (e.g. ``pollen.x.v_hat``), in either direction."""
    return EXTRA_RECORD_PREFIX + name


def join_keys(keys: tuple[str, ...] | list[str]) -> str:
    """Encode a list of array names for a ConfigRecord (names never hold a newline)."""
    return "\n".join(keys)


def split_keys(joined: str) -> tuple[str, ...]:
    return tuple(name for name in joined.split("\n") if name)
