"""The station's identity: enrolment, certificate renewal, the manager keys it trusts."""
