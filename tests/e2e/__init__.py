"""The end-to-end layer: real rank processes over the ring backend on loopback, servers, a real
sshd, a rig of hosts made of network namespaces."""
