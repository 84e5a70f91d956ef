"""dropin-app: a Flower ServerApp (as `flwr new` makes it) that can also run Sheaf-FRL."""

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from dropin_app.task import Net
from flwr_sheaf import FederationConfig, LocalTrainConfig, SheafConfig, SheafFRL, write_results
from flwr_sheaf.results import check_results_dir
from flwr_sheaf.tracking import Tracker

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context):
    """Run the app's FedAvg, or Sheaf-FRL on the same SuperNodes (run config ``strategy``)."""
    rc = context.run_config
    num_rounds = rc["num-server-rounds"]
    if rc["strategy"] == "fedavg":
        strategy = FedAvg(fraction_train=rc["fraction-train"])
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(Net().state_dict()),
            train_config=ConfigRecord({"lr": rc["lr"]}),
            num_rounds=num_rounds,
        )
        return result
    # --- flwr-sheaf: personalised models, only whitened pilot latents travel -----------------------
    strategy = SheafFRL(
        num_nodes=rc["num-nodes"],
        federation=FederationConfig(graph="ring"),
        train=LocalTrainConfig(local_epochs=rc["local-epochs"], lr=rc["lr"]),
        sheaf=SheafConfig(lam=rc["lambda"]),
    )
    # before any message: refuses another run's results (or a live run's directory) and warns of
    # run-config keys the strategy does not apply; the directory stays this run's until written
    out = check_results_dir(
        rc["results-dir"], overwrite=rc["overwrite"], strategy=strategy, config=rc
    )
    # optional per-round tracking ("tensorboard", "wandb" or both; docs/tracking.md)
    tracker = Tracker(rc["tracking"], out / "tracking", config=rc) if rc["tracking"] else None
    if tracker is not None:
        strategy.round_callbacks.append(tracker.log_round)
    try:
        strategy.start(grid=grid, num_rounds=num_rounds)
    finally:
        if tracker is not None:
            tracker.close()
    # results.json + accuracy.png, as `flwr run` of flwr-sheaf's own app writes them
    path = write_results(
        strategy,
        out,
        config=rc,
        overwrite=rc["overwrite"],
        problems=tracker.problems if tracker is not None else (),  # tracking broke: degraded
    )
    last = strategy.history[-1]
    print(
        f"private accuracy {last['private_accuracy_mean']:.3f}, "
        f"communication accuracy {last['communication_accuracy_degree_weighted']:.3f}; "
        f"results in {path}"
    )
    return strategy
