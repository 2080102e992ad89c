#!/bin/sh
# Start a miner or a validator from environment variables (Docker, docker compose, pm2, systemd).
#   IOTA_ROLE            miner | validator                      (required)
#   IOTA_NETWORK         finney | test | local | ws://host:port | devnet      (finney)
#   IOTA_CHAIN_DB        devnet SQLite file (with IOTA_NETWORK=devnet)
#   IOTA_NETUID          subnet uid                               (9)
#   IOTA_WALLET_NAME / IOTA_WALLET_HOTKEY / IOTA_WALLET_PATH       (default / default / ~/.bittensor/wallets)
#   IOTA_CONFIG          run config                               (configs/tiny.yaml)
#   IOTA_RUN_ID          run id shared by the run's neurons       (the config's name)
#   IOTA_OUT             state folder (checkpoints, nonces, status)  (/data/$IOTA_ROLE)
#   IOTA_PORT            listen port                              (8091)
#   IOTA_EXTERNAL_IP     address published on chain               (required off a devnet)
#   IOTA_DASHBOARD_PORT  web dashboard and /metrics port          (off)
#   IOTA_STAGE           (miner) stage to hold                    (the emptiest)
#   IOTA_DATA            (validator) text source
#   IOTA_DEVICE          cpu | cuda                               (cuda when present)
#   IOTA_EXTRA_ARGS      more options, appended as they are
#   IOTA_DRY_RUN=1       print the command instead of running it
set -eu
ROLE=${IOTA_ROLE:-}
case "$ROLE" in
  miner|validator) ;;
  *) echo "error: set IOTA_ROLE to miner or validator (got '$ROLE')" >&2; exit 2 ;;
esac
NETWORK=${IOTA_NETWORK:-finney}
if [ -z "${IOTA_EXTERNAL_IP:-}" ] && [ "$NETWORK" != devnet ] && [ "$NETWORK" != local ]; then
  echo "error: set IOTA_EXTERNAL_IP to the public address other neurons reach this $ROLE at" >&2
  exit 2
fi
set -- "$ROLE" --network "$NETWORK" --netuid "${IOTA_NETUID:-9}" \
  --wallet-name "${IOTA_WALLET_NAME:-default}" --wallet-hotkey "${IOTA_WALLET_HOTKEY:-default}" \
  --wallet-path "${IOTA_WALLET_PATH:-$HOME/.bittensor/wallets}" \
  --config "${IOTA_CONFIG:-configs/tiny.yaml}" --out "${IOTA_OUT:-/data/$ROLE}" \
  --host 0.0.0.0 --port "${IOTA_PORT:-8091}" --external-ip "${IOTA_EXTERNAL_IP:-127.0.0.1}"
[ -n "${IOTA_CHAIN_DB:-}" ] && set -- "$@" --chain-db "$IOTA_CHAIN_DB"
[ -n "${IOTA_RUN_ID:-}" ] && set -- "$@" --run-id "$IOTA_RUN_ID"
[ -n "${IOTA_DASHBOARD_PORT:-}" ] && set -- "$@" --dashboard-port "$IOTA_DASHBOARD_PORT"
[ -n "${IOTA_DEVICE:-}" ] && set -- "$@" --device "$IOTA_DEVICE"
if [ "$ROLE" = miner ]; then
  [ -n "${IOTA_STAGE:-}" ] && set -- "$@" --stage "$IOTA_STAGE"
else
  [ -n "${IOTA_DATA:-}" ] && set -- "$@" --data "$IOTA_DATA"
fi
# shellcheck disable=SC2086  # IOTA_EXTRA_ARGS is split on purpose
[ -n "${IOTA_EXTRA_ARGS:-}" ] && set -- "$@" $IOTA_EXTRA_ARGS
if [ "${IOTA_DRY_RUN:-0}" = 1 ]; then
  printf '%s\n' "${IOTA_BIN:-iota-subnet}" "$@"
  exit 0
fi
exec "${IOTA_BIN:-iota-subnet}" "$@"
