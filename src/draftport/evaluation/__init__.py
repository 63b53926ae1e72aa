"""Measuring drafters: offline accept length (accept), the drift probe (drift), the serving cost
model (costmodel) and the decision with its bootstrap CIs (decision)."""
