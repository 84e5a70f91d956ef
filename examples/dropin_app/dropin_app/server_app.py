"""dropin-app: a Flower ServerApp (as `flwr new` makes it) that can also run Sheaf-FRL."""

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from dropin_app.task import Net

from flwr_sheaf.strategy.sheaf_frl import SheafFRL

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context):
    """Run the app's FedAvg, or Sheaf-FRL on the same SuperNodes (run config ``strategy``)."""
    rc = context.run_config
    num_rounds = rc["num-server-rounds"]
    if rc["strategy"] == "fedavg":
        strategy = FedAvg(fraction_train=rc["fraction-train"])
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                                train_config=ConfigRecord({"lr": rc["lr"]}), num_rounds=num_rounds)
        return result
    # --- flwr-sheaf: personalised models, only latent pilots travel --------------------------------
    strategy = SheafFRL(num_nodes=rc["num-nodes"], graph="ring", num_rounds=num_rounds,
                        train_config={"lambda": rc["lambda"], "local-epochs": rc["local-epochs"], "lr": rc["lr"],
                                      "batch-size": 32})
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=num_rounds)
    last = strategy.history[-1]
    print(f"private accuracy {last['private_accuracy_mean']:.3f}, "
          f"communication accuracy {last['communication_accuracy_degree_weighted']:.3f}")
    return strategy
