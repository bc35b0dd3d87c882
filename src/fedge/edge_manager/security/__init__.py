"""The fleet's PKI and trust: CA, credentials, enrolment, renewal, operators, key rotation."""
