"""The station as a federated party: its SuperNode, supervised while its config says train."""
