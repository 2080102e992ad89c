// pm2 process file: `pm2 start deploy/ecosystem.config.js --only iota-miner` (or iota-validator).
// Install first (deploy/install.sh /opt/iota-subnet/.venv), export the settings of
// deploy/iota-subnet.env.example in the shell, then start; `pm2 save && pm2 startup` keeps it across reboots.
const path = require("path");
const root = path.resolve(__dirname, "..");
const venv = process.env.IOTA_VENV || path.join(root, ".venv");

function neuron(role, port, extra) {
  return {
    name: `iota-${role}`,
    cwd: root,
    script: path.join(root, "deploy", "entrypoint.sh"),
    interpreter: "sh",
    autorestart: true,
    restart_delay: 5000,          // ms; the neuron resumes from its last checkpoint
    max_restarts: 100,
    kill_timeout: 60000,          // ms between SIGTERM and SIGKILL: time to write the final checkpoint
    env: Object.assign({
      IOTA_ROLE: role,
      IOTA_PORT: String(port),
      PATH: `${path.join(venv, "bin")}:${process.env.PATH}`,
      OMP_NUM_THREADS: process.env.OMP_NUM_THREADS || "4",
      TOKENIZERS_PARALLELISM: "false",
      PYTHONUNBUFFERED: "1",
    }, extra),
  };
}

module.exports = {
  apps: [
    neuron("miner", process.env.IOTA_MINER_PORT || 8091, { IOTA_WALLET_HOTKEY: process.env.IOTA_MINER_HOTKEY || "miner" }),
    neuron("validator", process.env.IOTA_VALIDATOR_PORT || 8093, {
      IOTA_WALLET_HOTKEY: process.env.IOTA_VALIDATOR_HOTKEY || "validator",
      IOTA_DASHBOARD_PORT: process.env.IOTA_DASHBOARD_PORT || "8092",
    }),
  ],
};
