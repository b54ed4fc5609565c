"""The prefill and decode daemons: control plane, lifecycle and the transfer paths."""
