"""Every pollen strategy, with its constructor defaults, dropped into a quickstart-style Flower project.

The project below is written the way Flower's PyTorch quickstart writes it: its ``Net`` (LeNet on
32x32x3 images), a ``ClientApp`` whose ``@app.train()`` loads the received ``ArrayRecord``, trains
one epoch of ``SGD(lr, momentum=0.9)`` with batches of 32 and replies ``{"arrays", "metrics"}``,
and an ``@app.evaluate()``. Its data are local and synthetic (CIFAR-like: 10 classes of coloured
textures under heavy noise, 4 IID clients, a shared test set), made here from a seed; the noise is
chosen so that no strategy saturates in 10 rounds (FedAvg ends near 0.7), so the comparison can fail.

Each strategy then runs 10 rounds in process: a :class:`~pollen.testing.fakes.FakeGrid` hands every
message to the ClientApp with one persistent ``Context`` per node, as a SuperNode would, and a
centralised ``evaluate_fn`` measures test accuracy. The only arguments set are sampling ones, as a
user swapping ``FedAvg(...)`` for a pollen strategy would keep them. The references run in the same
test: Flower's own ``FedAdam()`` and ``FedAvg()``, both with no arguments. A strategy's score is the
mean of its last three evaluations, averaged over seeds 0-2; none may end more than 5 points below
FedAdam's (issue 25, "Drop-in defaults"), and none may diverge.

Strategies whose method needs pollen's own client step cannot be dropped into a foreign ClientApp;
for them the test checks that every reply is rejected with a reason that says what is missing (or
that the run stops before round 1 with one line), never that the run silently "works".

Measured (this project, mean of the last three of 10 rounds, seeds 0 / 1 / 2, and their mean)::

    FedAvg()                         0.816 0.692 0.603   0.704
    FedAdam()  (reference)           0.875 0.629 0.663   0.722
    FedAMS()                         0.888 0.818 0.692   0.799
    FedAMS(option=2)                 0.897 0.861 0.793   0.850
    FedCAMS() + compression_mod      0.824 0.697 0.600   0.707
    FedAdaVR()                       0.914 0.857 0.707   0.826
    FedAdaVR(variant='mifa')         0.828 0.675 0.640   0.714
    FedAdaVR(variant='fedvarp')      0.828 0.675 0.640   0.714
    FedLAMB(variant='fed-sgd')       0.828 0.670 0.643   0.714
    FedLAMB(variant='adp-fed')       0.916 0.912 0.810   0.879
    HAFed(identity, clustered=False) 0.923 0.927 0.805   0.885
    FedLazy() + lazy_mod             0.888 0.818 0.692   0.799

How the constructor defaults were chosen (issue 14, on the easier version of this project, 5 rounds,
seeds 0-2; FedAvg 1.000 / 1.000 / 0.995)::

    strategy                      old defaults          acc (seeds 0/1/2)    new defaults            acc (seeds 0/1/2)
    FedAMS()                      eta=1, eps=1e-3       0.983 0.377 0.733    eta=0.003, eps=1e-8     1.000 0.985 0.960
    FedAMS(option=2)              eta=1, eps=1e-3       0.142 0.112 0.100    eta=0.003, eps=1e-8     1.000 0.975 0.965
    FedCAMS() (sign, EF)          eta=1, eps=1e-3       0.988 1.000 0.983    eta=0.003, eps=1e-8     1.000 0.965 0.952
    FedLAMB(variant="adp-fed")    eta=0.01              0.985 0.925 0.925    eta=0.003               1.000 1.000 0.998

Grid (mean over seeds 0-2): FedAMS Option 1 with eps=1e-3 is erratic in eta (1: 0.70, 0.3: 0.97, 0.1: 0.70,
0.03: 0.42, 0.01: 0.14); with eps=1e-8 it fails for eta >= 0.03 (<= 0.60) and holds for eta in
{0.01, 0.005, 0.003} (0.993, 0.993, 0.982); Option 2 and FedCAMS alike (FedCAMS eps=1e-8: eta 0.01 /
0.005 / 0.003 -> 0.993 / 0.968 / 0.972, eta >= 0.03 <= 0.44). Adp-Fed: eta 0.1 / 0.03 / 0.02 / 0.01 /
0.005 / 0.003 / 0.001 -> 0.13 / 0.17 / 0.75 / 0.945 / 0.991 / 0.999 / 0.932. Of the working range, 0.003
was chosen over 0.01 because pollen's Fashion-MNIST CNN (20 clients, Dirichlet 0.5, 5 per round, 20
local steps, 10 rounds, seeds 1-2) ends at 0.742 / 0.780 with FedAMS(eta=0.003, eps=1e-8) and at 0.643 /
0.652 with eta=0.01 (FedAvg 0.774 / 0.751); Adp-Fed there: 0.747 (0.003) vs 0.694 (0.01).
Issue 25 reports FedAMS() about 30 points behind FedAdam() after 5 rounds of Flower's real
quickstart-pytorch on CIFAR-10, which this machine cannot download; on this project it is ahead.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from functools import cache

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAdam, FedAvg

from pollen.clientside import compression_mod
from pollen.clientside.lazy_mod import lazy_mod
from pollen.strategies import FedAdaVR, FedAMS, FedCAMS, FedLAMB, FedLazy, HAFed
from pollen.strategies.rounds import SetupError
from pollen.testing.fakes import FakeGrid
from pollen.testing.relay_demo import RelayAverage

NUM_CLIENTS = 4
NUM_ROUNDS = 10
TRAIN_PER_CLIENT = 400
TEST_SIZE = 400
NUM_CLASSES = 10
NOISE = 3.0
CONTRAST = 0.7
SHIFT = 4
SEED = 1  # of the single-seed checks below
SEEDS = (0, 1, 2)
LAST = 3  # a run's score: the mean of its last three evaluations
TOLERANCE = 0.05  # no strategy may end more than 5 points below Flower's FedAdam()


# --------------------------------------------------------------------------- the quickstart's task
class Net(torch.nn.Module):
    """Flower's quickstart model (LeNet, 'Deep Learning with PyTorch: A 60 Minute Blitz')."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 6, 5)
        self.pool = torch.nn.MaxPool2d(2, 2)
        self.conv2 = torch.nn.Conv2d(6, 16, 5)
        self.fc1 = torch.nn.Linear(16 * 5 * 5, 120)
        self.fc2 = torch.nn.Linear(120, 84)
        self.fc3 = torch.nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def make_images(labels: np.ndarray, rng: np.random.Generator, seed: int) -> np.ndarray:
    """CIFAR-like 32x32x3 images (values in about [-2.5, 2.5], as after normalisation): class textures plus noise.

    Class ``k`` has its own colour texture: a random 8x8x3 field smoothly upsampled to 36x36. An
    image of class ``k`` is a random 32x32 crop of it (a shift of up to 4 pixels each way) plus
    Gaussian noise of standard deviation ``NOISE``, so the net needs its convolutions and a few
    rounds to tell the classes apart (FedAvg: chance after round 1, near 1.0 after round 5).
    """
    textures = torch.from_numpy(
        np.random.default_rng(1000 + seed).normal(size=(NUM_CLASSES, 3, 8, 8)).astype(np.float32)
    )
    textures = F.interpolate(textures, size=(32 + SHIFT, 32 + SHIFT), mode="bilinear", align_corners=False).numpy()
    dy, dx = rng.integers(0, SHIFT + 1, size=(2, len(labels)))
    images = np.stack([CONTRAST * textures[k, :, y : y + 32, x : x + 32] for k, y, x in zip(labels, dy, dx)])
    images += rng.normal(0.0, NOISE, size=images.shape)
    return np.clip(images, -4.0, 4.0).astype(np.float32)


@cache
def dataset(seed: int = SEED) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    """IID partitions of ``TRAIN_PER_CLIENT`` images for each client and a shared test set."""
    rng = np.random.default_rng(seed)
    n_train = NUM_CLIENTS * TRAIN_PER_CLIENT
    labels = rng.integers(0, NUM_CLASSES, size=n_train + TEST_SIZE)
    images = make_images(labels, rng, seed)
    x, y = torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))
    parts = [
        (x[i * TRAIN_PER_CLIENT : (i + 1) * TRAIN_PER_CLIENT], y[i * TRAIN_PER_CLIENT : (i + 1) * TRAIN_PER_CLIENT])
        for i in range(NUM_CLIENTS)
    ]
    return parts, (x[n_train:], y[n_train:])


def load_data(partition_id: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return dataset(seed)[0][partition_id]


def train_model(net: Net, images: torch.Tensor, labels: torch.Tensor, epochs: int, lr: float) -> float:
    """The quickstart's ``train``: SGD with momentum 0.9, batch 32, shuffled; the mean batch loss.

    Shuffling uses torch's global generator, as the quickstart's DataLoader does; clients run one
    after another in this process from ``torch.manual_seed(seed)``, so a run is reproducible.
    """
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss, batches = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(images))
        for start in range(0, len(images), 32):
            batch = order[start : start + 32]
            optimizer.zero_grad()
            loss = criterion(net(images[batch]), labels[batch])
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            batches += 1
    return running_loss / batches


def evaluate_model(net: Net, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """The quickstart's ``test`` (renamed so pytest does not collect it): mean loss and accuracy."""
    net.eval()
    with torch.no_grad():
        logits = net(images)
        loss = float(F.cross_entropy(logits, labels))
        accuracy = float((logits.argmax(1) == labels).float().mean())
    return loss, accuracy


# --------------------------------------------------------------------------- the quickstart's ClientApp
app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    partition_id = int(context.node_config["partition-id"])
    images, labels = load_data(partition_id, int(context.run_config["seed"]))
    train_loss = train_model(model, images, labels, epochs=1, lr=float(msg.content["config"]["lr"]))
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(images)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    images, labels = load_data(int(context.node_config["partition-id"]), int(context.run_config["seed"]))
    eval_loss, eval_acc = evaluate_model(model, images, labels)
    metrics = MetricRecord({"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(images)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


#: The same train function behind pollen's compression mod (what FedCAMS needs from a project).
app_with_mod = ClientApp(mods=[compression_mod])
app_with_mod.train()(train)
app_with_mod.evaluate()(evaluate)
app_with_lazy_mod = ClientApp(mods=[lazy_mod])
app_with_lazy_mod.train()(train)
app_with_lazy_mod.evaluate()(evaluate)


# --------------------------------------------------------------------------- running a strategy
def run_project(
    strategy, *, seed: int = SEED, client_app: ClientApp = app, num_rounds: int = NUM_ROUNDS
) -> dict[int, float]:
    """Run ``strategy`` on the project in process; the centralised test accuracy of every round.

    A ClientApp that raises (e.g. for a message type it has no function for) answers with an
    ``Error`` reply, as the SuperNode's runtime does.
    """
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    random.seed(seed)  # Flower's FedAvg samples (and orders) nodes with Python's random
    net = Net()
    contexts = {
        node: Context(
            run_id=1,
            node_id=node,
            node_config={"partition-id": node - 1, "num-partitions": NUM_CLIENTS},
            state=RecordDict(),
            run_config={"seed": seed},
        )
        for node in range(1, NUM_CLIENTS + 1)
    }

    def client_fn(msg: Message) -> Message:
        try:
            return client_app(msg, contexts[msg.metadata.dst_node_id])
        except Exception as err:  # noqa: BLE001 - the runtime turns it into an error reply
            return Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=msg)

    test_images, test_labels = dataset(seed)[1]
    accuracy: dict[int, float] = {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate_model(model, test_images, test_labels)
        accuracy[server_round] = acc if math.isfinite(loss) else float("nan")
        return MetricRecord({"loss": loss, "accuracy": acc})

    # No client_ids: a foreign ClientApp cannot answer pollen's identify query (the grid answers it
    # with an error, as Flower's runtime would), so strategies fall back to node ids.
    grid = FakeGrid(list(contexts), client_fn)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(net.state_dict()),
        num_rounds=num_rounds,
        train_config=ConfigRecord({"lr": 0.01}),
        evaluate_fn=evaluate_fn,
    )
    return accuracy


#: What a user would keep from the quickstart when swapping the strategy: sampling only.
SAMPLING = {"fraction_train": 1.0, "fraction_evaluate": 0.0}

#: Strategies that drop in, with their constructor defaults (name, factory, ClientApp).
DROP_IN: list[tuple[str, Callable[[], object], ClientApp]] = [
    ("FedAMS()", lambda: FedAMS(**SAMPLING), app),
    ("FedAMS(option=2)", lambda: FedAMS(option=2, **SAMPLING), app),
    ("FedCAMS() + compression_mod", lambda: FedCAMS(**SAMPLING), app_with_mod),
    ("FedAdaVR()", lambda: FedAdaVR(**SAMPLING), app),
    ("FedAdaVR(variant='mifa')", lambda: FedAdaVR(variant="mifa", **SAMPLING), app),
    ("FedAdaVR(variant='fedvarp')", lambda: FedAdaVR(variant="fedvarp", **SAMPLING), app),
    ("FedLAMB(variant='fed-sgd')", lambda: FedLAMB(variant="fed-sgd", **SAMPLING), app),
    ("FedLAMB(variant='adp-fed')", lambda: FedLAMB(variant="adp-fed", **SAMPLING), app),
    ("HAFed(identity, clustered=False)", lambda: HAFed(topology="identity", clustered=False, **SAMPLING), app),
    ("FedLazy() + lazy_mod", lambda: FedLazy(**SAMPLING), app_with_lazy_mod),
]


def score(make: Callable[[], object], client_app: ClientApp = app) -> tuple[float, list[float]]:
    """The mean over :data:`SEEDS` of each run's last-three-rounds mean accuracy, and the per-seed values."""
    per_seed = []
    for seed in SEEDS:
        accuracy = run_project(make(), seed=seed, client_app=client_app)
        per_seed.append(sum(accuracy[r] for r in range(NUM_ROUNDS - LAST + 1, NUM_ROUNDS + 1)) / LAST)
    return sum(per_seed) / len(per_seed), per_seed


@cache
def references() -> dict[str, float]:
    """Flower's own strategies with no arguments (sampling aside), on this project: the bar."""
    return {"FedAvg()": score(lambda: FedAvg(**SAMPLING))[0], "FedAdam()": score(lambda: FedAdam(**SAMPLING))[0]}


#: The two tests that use :func:`references` run on one xdist worker, so its six runs are made once.
REFERENCES_GROUP = pytest.mark.xdist_group("dropin-references")


@pytest.mark.slow
@REFERENCES_GROUP
def test_the_project_learns_with_flowers_strategies_without_saturating() -> None:
    """The bar is meaningful: Flower's strategies learn (chance is 0.1) and leave room to fall behind."""
    for name, value in references().items():
        assert 0.5 <= value <= 0.95, (name, value)


def test_the_quickstart_evaluate_answers() -> None:
    """The project's ``@app.evaluate()`` works on a model the server sends (Flower's federated evaluation)."""
    net = Net()
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "config": ConfigRecord()})
    msg = Message(content=content, dst_node_id=1, message_type="evaluate")
    context = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 0, "num-partitions": NUM_CLIENTS},
        state=RecordDict(),
        run_config={"seed": SEED},
    )
    metrics = app(msg, context).content["metrics"]
    assert metrics["num-examples"] == TRAIN_PER_CLIENT and 0.0 <= metrics["eval_acc"] <= 1.0


@pytest.mark.slow  # 12 strategies x 3 seeds x 10 rounds: about 3 minutes on 2 cores
@REFERENCES_GROUP
def test_every_strategy_with_its_defaults_keeps_up_with_flowers_fedadam() -> None:
    bar = references()["FedAdam()"]
    rows = [(name, value, []) for name, value in references().items()]
    for name, make, client_app in DROP_IN:
        strategy = make()
        value, per_seed = score(make, client_app)
        rows.append((name, value, per_seed))
        if isinstance(strategy, FedCAMS):  # the mod really compressed: scaled sign, about 1/32 of fp32
            run_project(strategy, client_app=client_app, num_rounds=1)
            stats = strategy.accounting.round(1)
            assert 0 < 16 * stats.uplink_update_bytes < stats.uplink_fp32_bytes, stats
    print(f"\nmean of the last {LAST} of {NUM_ROUNDS} rounds, seeds {SEEDS} ({NUM_CLIENTS} clients):")
    for name, value, per_seed in rows:
        print(f"  {name:<36} {value:.3f}  {' '.join(f'{v:.3f}' for v in per_seed)}")
    assert all(math.isfinite(value) and all(math.isfinite(v) for v in per_seed) for _, value, per_seed in rows), rows
    behind = [(name, round(value, 3)) for name, value, _ in rows if not value >= bar - TOLERANCE]
    assert not behind, f"below Flower's FedAdam() ({bar:.3f}) by more than {TOLERANCE}: {behind}"
    diverged = [(name, per_seed) for name, _, per_seed in rows if per_seed and min(per_seed) < 0.3]
    assert not diverged, f"ended near chance on a seed: {diverged}"


# --------------------------------------------------------------------------- methods that need pollen's client
#: Each needs something only pollen's ClientApp does: Fed-LAMB / Mime-LAMB / Fed-AMS / Mime upload a
#: statistic with the model (local ``v`` or a full-batch gradient) and run pollen's local step;
#: RelayAverage answers a mid-round ``train.pollen_phase`` message; HA-Fed with gossip (below) needs
#: each node's cluster id and answers gossip messages.
NEEDS_POLLEN_CLIENT = [
    ("FedLAMB()", lambda: FedLAMB(**SAMPLING), "reply lacks the extra record 'pollen.x.v'"),
    (
        "FedLAMB(variant='mime-lamb')",
        lambda: FedLAMB(variant="mime-lamb", **SAMPLING),
        "reply lacks the extra record 'pollen.x.grad'",
    ),
    (
        "FedLAMB(variant='fed-ams')",
        lambda: FedLAMB(variant="fed-ams", **SAMPLING),
        "reply lacks the extra record 'pollen.x.v'",
    ),
    (
        "FedLAMB(variant='mime')",
        lambda: FedLAMB(variant="mime", **SAMPLING),
        "reply lacks the extra record 'pollen.x.grad'",
    ),
    ("RelayAverage()", lambda: RelayAverage(**SAMPLING), "No train function registered with name 'pollen_phase'"),
]


@pytest.mark.parametrize(("name", "make", "reason"), NEEDS_POLLEN_CLIENT, ids=[n for n, _, _ in NEEDS_POLLEN_CLIENT])
def test_methods_that_need_pollens_client_reject_every_reply_with_a_reason(
    name: str, make: Callable, reason: str
) -> None:
    strategy = make()
    accuracy = run_project(strategy, num_rounds=1)
    reasons = strategy.accounting.round(1).failure_reasons
    assert len(reasons) >= NUM_CLIENTS and all(reason in r for r in reasons[:NUM_CLIENTS]), reasons
    assert accuracy[1] == accuracy[0]  # the model did not move


def test_hafed_with_gossip_stops_before_round_1_without_cluster_ids() -> None:
    """HA-Fed's gossip needs clusters that pollen's ClientApp reports; a foreign one cannot."""
    with pytest.raises(SetupError, match="cluster id"):
        run_project(HAFed(**SAMPLING), num_rounds=1)
