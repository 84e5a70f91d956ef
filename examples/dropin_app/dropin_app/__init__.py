"""dropin-app: a Flower app with flwr-sheaf dropped in."""
