"""anchorapp's ClientApp: train the global model for K steps on this node's share, send it back."""

from logging import INFO

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log

from anchorapp.task import Net, load_data
from anchorapp.task import train as train_fn

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    torch.manual_seed(int(context.run_config["seed"]))
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    loader = load_data(
        str(context.run_config["data-dir"]),
        partition_id,
        num_partitions,
        int(context.run_config["seed"]),
        int(context.run_config["batch-size"]),
    )
    steps = int(context.run_config["local-steps"])
    train_loss = train_fn(model, loader, steps, float(msg.content["config"]["lr"]))
    log(INFO, "[anchor] partition %d trained %d steps", partition_id, steps)
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(loader.dataset)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)
