#!/usr/bin/env bash
# scripts/slurm_local.sh -- a throwaway single-node Slurm (22.05, Debian) for testing the
# Snakemake slurm executor path (profiles/slurm-test) on one machine, as root, without systemd.
#
# Usage:
#   scripts/slurm_local.sh install   # apt-get install slurmctld slurmd slurm-client munge (no-op if present;
#                                    # exit 3 if apt-get is unavailable)
#   scripts/slurm_local.sh up        # write config + start munged, slurmctld, slurmd; wait for node idle
#   scripts/slurm_local.sh status    # daemons (by pid file), sinfo, squeue
#   scripts/slurm_local.sh env       # print `export SLURM_CONF=...` (eval "$(scripts/slurm_local.sh env)")
#   scripts/slurm_local.sh down      # scancel everything, stop exactly our daemons, remove what we created
#
# Environment:
#   SLURM_LOCAL_DIR        state dir (config, logs, pid files, spool, munge key/socket, fake GPU devices);
#                          default /tmp/stem-slurm
#   SLURM_LOCAL_GPUS       number of fake GPUs on the node (default 2)
#   SLURM_LOCAL_TIMEOUT    seconds `up` waits for the node to become idle (default 60)
#   SLURM_LOCAL_LINK_ETC   1 (default): if /etc/slurm/slurm.conf does not exist, symlink it to the state dir
#                          so sbatch/squeue/sinfo work without SLURM_CONF; removed again by `down`.
#                          0: never touch /etc; then export SLURM_CONF=$SLURM_LOCAL_DIR/slurm.conf yourself.
#   SLURM_LOCAL_CTLD_PORT / SLURM_LOCAL_SLURMD_PORT   (defaults 6817 / 6818)
#
# Layout: everything lives in $SLURM_LOCAL_DIR; the only things created outside it are the optional
# /etc/slurm/slurm.conf symlink (and /etc/slurm if absent), both listed in $SLURM_LOCAL_DIR/created.txt.
# GPUs are fake: character devices (major 195, like /dev/nvidia*) under $SLURM_LOCAL_DIR/dev, listed in
# gres.conf with AutoDetect=off. They are for scheduling only (--gpus=N / --gres=gpu:N both schedule;
# CUDA_VISIBLE_DEVICES is set in the job), there is no real GPU behind them.
# The daemons are started with STEM_SLURM_LOCAL=<state dir> in their environment, so `down` can also find
# slurmstepd processes that outlive slurmd (it only kills processes carrying that marker).
# Notes: Snakemake's slurm executor needs `slurm-status-command: squeue` here (no accounting => no sacct).
#        MinJobAge=300 keeps finished jobs visible to squeue long enough for the executor to see them.
#        A failed `up` leaves its daemons/state for inspection (logs are printed); run `down` to clean up.
#        "mpi/pmix ... can not load PMIx library" errors in the logs are harmless noise (MpiDefault=none).
#        No accounting: sacct/sacctmgr fail; `scontrol show job` / `squeue -t all` show finished jobs
#        for MinJobAge seconds. `sbatch --wait` polls slowly (~10 s round trip even for `hostname`).
#        Timings here (gVisor VM, 2 CPUs): install ~8 s (from apt), up <1 s, down ~6 s (waits for
#        cancelled jobs to leave the queue).
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/stem-slurm}
NGPU=${SLURM_LOCAL_GPUS:-2}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
LINK_ETC=${SLURM_LOCAL_LINK_ETC:-1}
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_LOCAL_SLURMD_PORT:-6818}
CONF=$DIR/slurm.conf
MARK=STEM_SLURM_LOCAL

log() { echo "[slurm_local] $*" >&2; }
die() { log "ERROR: $1"; exit "${2:-1}"; }

need_root() { [[ $(id -u) -eq 0 ]] || die "must run as root (starts daemons, creates device nodes)"; }

binaries_present() {
    local b
    for b in slurmctld slurmd sbatch squeue sinfo scancel munged; do
        command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b ]] || return 1
    done
}

slurm_version() {  # `sinfo --version` needs a config, so ask dpkg (or fall back to slurmd -V)
    dpkg-query -W -f='slurm ${Version}, munge ' slurm-client 2>/dev/null && dpkg-query -W -f='${Version}' munge 2>/dev/null \
        || slurmd -V 2>/dev/null || echo '?'
}

cmd_install() {
    if binaries_present; then
        log "slurm + munge already installed: $(slurm_version)"
        return 0
    fi
    command -v apt-get >/dev/null 2>&1 || die "apt-get not available; install slurmctld slurmd slurm-client munge by other means" 3
    need_root
    # keep postinst scripts from starting daemons we do not track
    local made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && made_policy=1
    fi
    local pkgs=(slurmctld slurmd slurm-client munge) rc=0
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${pkgs[@]}" || {
        log "apt-get install failed; retrying after apt-get update"
        apt-get update -q && apt-get install -y -q --no-install-recommends "${pkgs[@]}"
    } || rc=$?
    [[ $made_policy -eq 1 ]] && rm -f /usr/sbin/policy-rc.d
    [[ $rc -eq 0 ]] || die "apt-get install ${pkgs[*]} failed (rc=$rc)" "$rc"
    binaries_present || die "packages installed but binaries still missing"
    log "installed: $(slurm_version)"
}

# --- pid-file helpers ---------------------------------------------------------------------------
pidfile() {  # munged runs as user munge, so its pid file lives in the munge-owned dir
    if [[ $1 == munged ]]; then echo "$DIR/munge/munged.pid"; else echo "$DIR/run/$1.pid"; fi
}

pid_of() {  # name -> pid if its pid file names a live process, else empty
    local f pid
    f=$(pidfile "$1")
    [[ -s $f ]] || return 0
    pid=$(tr -dc 0-9 <"$f")
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
    # guard against pid reuse: the process must be the daemon and carry our marker
    { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qx "$MARK=$DIR" || return 0
    echo "$pid"
}

marked_pids() {  # every live process carrying our marker (daemons, slurmstepd)
    local p
    for p in /proc/[0-9]*; do
        { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qx "$MARK=$DIR" && echo "${p#/proc/}"
    done
    return 0
}

descendants() {  # pids... -> all their descendants (deepest first)
    [[ $# -gt 0 ]] || return 0
    local table kids p
    table=$(ps -eo pid=,ppid=)
    kids=$(awk -v roots=" $* " 'index(roots, " " $2 " ") {print $1}' <<<"$table")
    [[ -n $kids ]] || return 0
    # shellcheck disable=SC2086
    descendants $kids
    echo "$kids"
}

tail_logs() {
    local f
    for f in "$DIR"/log/*.log; do
        [[ -e $f ]] || continue
        echo "----- tail $f -----" >&2
        tail -n 25 "$f" >&2
    done
}

record() { grep -qxF "$1" "$DIR/created.txt" 2>/dev/null || echo "$1" >>"$DIR/created.txt"; }

# --- config -------------------------------------------------------------------------------------
write_config() {
    local host cpus mem_kb mem
    host=$(hostname -s)
    cpus=$(nproc)
    mem_kb=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
    # headroom: 10% or at least 1 GiB below MemTotal (slurmd drains the node if RealMemory > actual)
    mem=$(( mem_kb / 1024 ))
    mem=$(( mem - (mem / 10 > 1024 ? mem / 10 : 1024) ))
    (( mem > 512 )) || mem=512
    local gmax=$(( NGPU - 1 ))
    mkdir -p "$DIR"/{run,log,ctld,spool,dev}
    chmod 755 "$DIR"

    cat >"$CONF" <<EOF
# generated by scripts/slurm_local.sh -- single-node test cluster, do not edit
ClusterName=stemlocal
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MailProg=/bin/true
GresTypes=gpu
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem Gres=gpu:$NGPU State=UNKNOWN
PartitionName=gpu Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    cat >"$DIR/gres.conf" <<EOF
# generated by scripts/slurm_local.sh -- fake GPUs (character devices 195,N), scheduling only
AutoDetect=off
NodeName=$host Name=gpu File=$DIR/dev/nvidia[0-$gmax]
EOF
    local i
    for (( i = 0; i < NGPU; i++ )); do
        [[ -c $DIR/dev/nvidia$i ]] || mknod -m 666 "$DIR/dev/nvidia$i" c 195 "$i"
    done
    chmod 644 "$CONF" "$DIR/gres.conf"
}

setup_munge() {
    local md=$DIR/munge
    mkdir -p "$md"
    if [[ ! -s $md/munge.key ]]; then
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile="$md/munge.key" --force >/dev/null
        else
            dd if=/dev/urandom of="$md/munge.key" bs=1024 count=1 status=none
        fi
    fi
    chown -R munge:munge "$md"
    chmod 755 "$md"          # socket dir must be reachable by clients
    chmod 400 "$md/munge.key"
    # munged is strict about the log file's directory: give it its own
    mkdir -p "$DIR/log/munge" && chown munge:munge "$DIR/log/munge" && chmod 755 "$DIR/log/munge"
}

link_etc() {
    [[ $LINK_ETC == 1 ]] || return 0
    if [[ -L /etc/slurm/slurm.conf && $(readlink /etc/slurm/slurm.conf) == "$CONF" ]]; then return 0; fi
    if [[ -e /etc/slurm/slurm.conf || -L /etc/slurm/slurm.conf ]]; then
        log "note: /etc/slurm/slurm.conf exists and is not ours; left alone -- export SLURM_CONF=$CONF"
        return 0
    fi
    if [[ ! -d /etc/slurm ]]; then mkdir -p /etc/slurm && record "dir:/etc/slurm"; fi
    ln -s "$CONF" /etc/slurm/slurm.conf && record "link:/etc/slurm/slurm.conf"
}

start_daemon() {  # name cmd...
    local name=$1; shift
    local pid
    pid=$(pid_of "$name")
    if [[ -n $pid ]]; then log "$name already running (pid $pid)"; return 0; fi
    rm -f "$(pidfile "$name")"
    log "starting $name"
    env "$MARK=$DIR" SLURM_CONF="$CONF" "$@" </dev/null >>"$DIR/log/$name.stdout" 2>&1 \
        || { tail_logs; die "$name failed to start"; }
    local t
    for (( t = 0; t < 50; t++ )); do
        pid=$(pid_of "$name")
        [[ -n $pid ]] && { log "$name pid $pid"; return 0; }
        sleep 0.2
    done
    tail_logs; cat "$DIR/log/$name.stdout" >&2 || true
    die "$name did not write a live pid file $(pidfile "$name")"
}

cmd_up() {
    need_root
    binaries_present || die "slurm/munge binaries missing: run '$0 install' first"
    local t0=$SECONDS running=0
    [[ -n $(pid_of munged)$(pid_of slurmctld)$(pid_of slurmd) ]] && running=1
    if [[ $running -eq 0 ]]; then
        write_config
        setup_munge
    else
        log "daemons already (partly) running in $DIR; keeping existing config"
    fi
    link_etc
    export SLURM_CONF=$CONF

    # munged daemonizes and writes its pid file; run it as the munge user
    start_daemon munged runuser -u munge -- munged \
        --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket.2" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munge/munged.log" \
        --seed-file="$DIR/munge/munged.seed"
    start_daemon slurmctld slurmctld -f "$CONF"
    start_daemon slurmd slurmd -f "$CONF"

    local host state=""
    host=$(hostname -s)
    while (( SECONDS - t0 < TIMEOUT )); do
        state=$(sinfo -h -N -n "$host" -o '%T' 2>/dev/null | head -n1 || true)
        case $state in
            idle|mixed|allocated) break ;;
            drain*|down*|inval*) scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true ;;
        esac
        sleep 0.5
    done
    if [[ ! $state =~ ^(idle|mixed|allocated)$ ]]; then
        log "node '$host' not idle after ${TIMEOUT}s (state='$state')"
        scontrol show node "$host" >&2 2>/dev/null || true
        tail_logs
        die "slurm did not come up; see logs above (state dir $DIR)"
    fi
    log "up in $(( SECONDS - t0 ))s: node $host is $state; SLURM_CONF=$CONF"
    sinfo -o '%P %a %D %T %c %m %G' >&2
}

cmd_status() {
    local n pid any=0
    for n in munged slurmctld slurmd; do
        pid=$(pid_of "$n")
        if [[ -n $pid ]]; then echo "$n: running (pid $pid)"; any=1; else echo "$n: not running"; fi
    done
    [[ $any -eq 1 ]] || { echo "state dir: $DIR (not up)"; return 1; }
    export SLURM_CONF=$CONF
    echo "SLURM_CONF=$CONF"
    sinfo -o '%P %a %D %T %c %m %G' || true
    squeue || true
}

cmd_env() { echo "export SLURM_CONF=$CONF"; }

stop_pid() {  # pid name
    local pid=$1 t
    kill -TERM "$pid" 2>/dev/null || return 0
    for (( t = 0; t < 50; t++ )); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    log "$2 (pid $pid) ignored SIGTERM; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

cmd_down() {
    need_root
    [[ -d $DIR ]] || { log "nothing to do ($DIR absent)"; return 0; }
    export SLURM_CONF=$CONF
    local pid n t
    if [[ -n $(pid_of slurmctld) ]]; then
        scancel --full --quiet --user=root 2>/dev/null || true
        scancel --full --quiet 2>/dev/null || true
        for (( t = 0; t < 30; t++ )); do
            [[ -z $(squeue -h -t PD,R,CG,S -o %i 2>/dev/null) ]] && break
            sleep 0.5
        done
    fi
    for n in slurmd slurmctld munged; do
        pid=$(pid_of "$n")
        if [[ -n $pid ]]; then log "stopping $n (pid $pid)"; stop_pid "$pid" "$n"; fi
    done
    # stragglers started by our slurmd (slurmstepd, e.g. if slurmd died before the jobs ended) carry the
    # marker; kill those and their process trees (the job scripts), by pid, children first
    local roots
    roots=$(marked_pids | grep -vx "$$" || true)
    for pid in $(descendants $roots) $roots; do
        kill -0 "$pid" 2>/dev/null || continue
        log "stopping leftover $({ tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null) (pid $pid)"
        stop_pid "$pid" leftover
    done
    # remove what we created outside the state dir
    if [[ -f $DIR/created.txt ]]; then
        while IFS= read -r item; do
            case $item in
                link:*) p=${item#link:}; [[ -L $p && $(readlink "$p") == "$CONF" ]] && rm -f "$p" ;;
                dir:*)  p=${item#dir:}; rmdir "$p" 2>/dev/null || log "note: $p not empty, left" ;;
            esac
        done < <(tac "$DIR/created.txt")
    fi
    case $DIR in /|/tmp|/etc|/usr|/var|/root|"") die "refusing to rm -rf '$DIR'" ;; esac
    rm -rf "$DIR"
    log "down: daemons stopped, $DIR removed"
}

case ${1:-} in
    install) cmd_install ;;
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) cmd_env ;;
    *) echo "usage: $0 {install|up|down|status|env}" >&2; exit 2 ;;
esac
