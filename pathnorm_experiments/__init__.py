"""The main job: data, the paper's network, training, PGD attacks, certificates, reproduction."""
