"""Adapters to the network and broker: the only modules that import paho-mqtt."""
