"""dropin-app: a Flower ClientApp (as `flwr new` makes it) plus the flwr-sheaf handlers."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dropin_app.task import Net, load_data
from dropin_app.task import test as test_fn
from dropin_app.task import train as train_fn

app = ClientApp()


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data (the app's own FedAvg path)."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader, _ = load_data(
        context.node_config["partition-id"], context.node_config["num-partitions"]
    )
    train_loss = train_fn(
        model, trainloader, context.run_config["local-epochs"], msg.content["config"]["lr"]
    )
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(trainloader.dataset)})
    return Message(
        RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg
    )


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, testloader = load_data(
        context.node_config["partition-id"], context.node_config["num-partitions"]
    )
    eval_loss, eval_acc = test_fn(model, testloader)
    metrics = MetricRecord(
        {"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(testloader.dataset)}
    )
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


# --- flwr-sheaf: two lines add query/train/evaluate handlers under the action "sheaf" -----------
from dropin_app.task import sheaf_task  # noqa: E402
from flwr_sheaf import register_sheaf_handlers  # noqa: E402

torch.set_num_threads(1)
register_sheaf_handlers(app, sheaf_task)
