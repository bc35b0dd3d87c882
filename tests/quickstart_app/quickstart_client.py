"""A ClientApp as Flower's PyTorch quickstart writes one, on scikit-learn's digits.

Nothing here knows fedge: a train handler that loads the received arrays, trains a few
local steps on this node's share of the data, and replies with ``arrays`` and a
``metrics`` record holding ``num-examples``.
"""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from sklearn.datasets import load_digits
from torch import nn

app = ClientApp()


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def load_data(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.data[partition_id::num_partitions] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[partition_id::num_partitions], dtype=torch.long)
    return x, y


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    partition = int(context.node_config["partition-id"])
    x, y = load_data(partition, int(context.node_config["num-partitions"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"train_loss": loss.item(), "num-examples": len(y)}),
        }
    )
    return Message(content=content, reply_to=msg)
