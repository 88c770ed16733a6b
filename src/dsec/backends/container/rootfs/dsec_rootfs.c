/* dsec-rootfs [--new-core-cookie] [--hide-net-sysctls] OPTIONS ROOTFS PROGRAM [ARG...]: mount a
 * sandbox's overlay root out of the host's sight, then exec the OCI runtime there.
 *
 * Unshares a mount namespace (private: nothing propagates back to the host), mounts overlayfs
 * with OPTIONS on ROOTFS and execs PROGRAM (found on PATH), which makes the container's
 * namespace from this one; the throw-away namespace dies with its last process. The edge used
 * to do this in a preexec_fn, which forces Python to fork() (not vfork) and so to copy the page
 * tables of an edge that holds thousands of sandboxes: 10+ ms per create at 3,000.
 *
 * --new-core-cookie: a fresh core scheduling cookie (PR_SCHED_CORE_CREATE) for this process,
 * inherited by the runtime and everything it starts (density/coresched.py says when).
 *
 * --hide-net-sysctls: an empty read-only tmpfs over /proc/sys/net in that namespace. runsc
 * 20221219 refuses to start netstack in any network namespace where
 * /proc/sys/net/core/rmem_default exists, taking it for the host's; since Linux 6.x every
 * namespace has it (gVisor issue 10704). The edge checks the namespace itself (gvisor.py).
 *
 * Failures before the exec go to stderr, which the edge reads; a successful exec leaves
 * stdin/stdout/stderr on /dev/null (crun keeps its caller's stdio open: a pipe would never end).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <unistd.h>

#ifndef PR_SCHED_CORE
#define PR_SCHED_CORE 62
#define PR_SCHED_CORE_CREATE 1
#endif
#define PIDTYPE_TGID 1

int main(int argc, char **argv) {
    int cookie = 0, hide_net = 0;
    while (argc > 1 && strncmp(argv[1], "--", 2) == 0) {
        if (strcmp(argv[1], "--new-core-cookie") == 0)
            cookie = 1;
        else if (strcmp(argv[1], "--hide-net-sysctls") == 0)
            hide_net = 1;
        else
            break;
        argc--;
        argv++;
    }
    if (argc < 4) {
        fprintf(stderr, "usage: dsec-rootfs [--new-core-cookie] [--hide-net-sysctls] OPTIONS ROOTFS PROGRAM [ARG...]\n");
        return 2;
    }
    if (unshare(CLONE_NEWNS) != 0) {
        fprintf(stderr, "unshare(CLONE_NEWNS): %s\n", strerror(errno));
        return 125;
    }
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) {
        fprintf(stderr, "making / private: %s\n", strerror(errno));
        return 125;
    }
    if (mount("overlay", argv[2], "overlay", 0, argv[1]) != 0) {
        fprintf(stderr, "mount overlay on %s: %s\n", argv[2], strerror(errno));
        return 125;
    }
    if (hide_net && mount("dsec-hidden", "/proc/sys/net", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                          "mode=0555,size=4k") != 0) {
        fprintf(stderr, "hiding /proc/sys/net: %s\n", strerror(errno));
        return 125;
    }
    if (cookie && prctl(PR_SCHED_CORE, PR_SCHED_CORE_CREATE, 0, PIDTYPE_TGID, 0) != 0) {
        fprintf(stderr, "core scheduling cookie: %s\n", strerror(errno));
        return 125;
    }
    int err = fcntl(2, F_DUPFD_CLOEXEC, 3); /* what a failed exec reports to; closed by a good one */
    int null = open("/dev/null", O_RDWR);
    if (err < 0 || null < 0 || dup2(null, 0) < 0 || dup2(null, 1) < 0 || dup2(null, 2) < 0) {
        fprintf(stderr, "redirecting stdio: %s\n", strerror(errno));
        return 125;
    }
    if (null > 2)
        close(null);
    execvp(argv[3], argv + 3);
    dprintf(err, "exec %s: %s\n", argv[3], strerror(errno));
    return 125;
}
