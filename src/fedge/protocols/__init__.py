"""The contract every fedge component speaks: messages, wire codecs, topics, signatures."""
