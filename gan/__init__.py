"""DCGAN: two models with two optimizers, set up pair by pair."""
