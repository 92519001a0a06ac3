"""End-to-end tests: real Flower processes (flwr run simulations, SuperLink and SuperNodes), drop-in projects."""
