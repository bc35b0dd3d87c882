"""Federations of real stations: fleet jobs that join the aggregator and the fleet."""
