/* dsec-rootfs [--new-core-cookie] [--hide-net-sysctls] [--own-root] OPTIONS ROOTFS PROGRAM [ARG...]:
 * mount a sandbox's overlay root out of the host's sight, then run the OCI runtime there.
 *
 * Unshares a mount namespace (private: nothing propagates back to the host), mounts overlayfs
 * with OPTIONS on ROOTFS and execs PROGRAM (found on PATH), which makes the container's
 * namespace from this one (runsc); the throw-away namespace dies with its last process. With
 * --own-root it becomes the container's namespace itself (crun). The edge used
 * to do this in a preexec_fn, which forces Python to fork() (not vfork) and so to copy the page
 * tables of an edge that holds thousands of sandboxes: 10+ ms per create at 3,000.
 *
 * --own-root: this namespace becomes the container's (its config asks for no mount namespace,
 * so crun mounts under ROOTFS here and chroots instead of pivot_root: pivot_root walks every
 * task on the host, 2 per held sandbox, ~10% of a node's CPU per create at 8,000). PROGRAM runs
 * as a child with one end of a socket pair at fd 3 (crun run --preserve-fds 1 hands it to the
 * init). When PROGRAM has succeeded, the host's tree leaves the namespace: a recursive clone of
 * the tree at ROOTFS is taken, the host's root is detached, and the clone is attached on the
 * namespace's own root, so the namespace holds the sandbox's mounts only, as after a
 * pivot_root, and processes that enter it later (dsec-enter) land in the clone. The init says
 * first that it runs (crun's child needs the first root's mounts until it has exec'd it), then,
 * still chrooted in the detached original, gets the clone's root over the socket and moves
 * there (dsec_init.c --new-root-on 3); its one-byte answer ends this helper. Exits with
 * PROGRAM's status, or 125.
 *
 * --new-core-cookie: a fresh core scheduling cookie (PR_SCHED_CORE_CREATE) for this process,
 * inherited by the runtime and everything it starts (density/coresched.py says when).
 *
 * --hide-net-sysctls: an empty read-only tmpfs over /proc/sys/net in that namespace. runsc
 * 20221219 refuses to start netstack in any network namespace where
 * /proc/sys/net/core/rmem_default exists, taking it for the host's; since Linux 6.x every
 * namespace has it (gVisor issue 10704). The edge checks the namespace itself (gvisor.py).
 *
 * The overlay's layer options name the layers by file descriptor ("lowerdir=4:5,upperdir=6,
 * workdir=7", resolved in /proc/self/fd): overlayfs shows its options in every mountinfo as
 * they were given, and the host paths (the data directory, the sandbox's own directory) are
 * none of a sandbox's business.
 *
 * Failures of this helper go to stderr, which the edge reads; PROGRAM runs with
 * stdin/stdout/stderr on /dev/null (crun keeps its caller's stdio open: a pipe would never end).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef PR_SCHED_CORE
#define PR_SCHED_CORE 62
#define PR_SCHED_CORE_CREATE 1
#endif
#define PIDTYPE_TGID 1
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif

/* Mount overlayfs with OPTIONS on target, every path of lowerdir, upperdir and workdir given
 * as the number of an fd opened on it and resolved from /proc/self/fd (see the top). Paths
 * may not hold ':', ',' or '\\' (the edge's never do): each is taken as it is. */
static int mount_overlay(const char *options, const char *target) {
    char out[8192], *opts = strdup(options), *save = NULL;
    int fds[512], nfds = 0, rc = -1;
    size_t len = 0;
    if (!opts)
        return -1;
    out[0] = 0;
    for (char *opt = strtok_r(opts, ",", &save); opt; opt = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(opt, '=');
        int layered = eq && (!strncmp(opt, "lowerdir=", 9) || !strncmp(opt, "upperdir=", 9) || !strncmp(opt, "workdir=", 8));
        int n = snprintf(out + len, sizeof out - len, "%s%.*s", len ? "," : "", layered ? (int)(eq - opt + 1) : (int)strlen(opt), opt);
        if (n < 0 || (size_t)n >= sizeof out - len)
            goto too_long;
        len += (size_t)n;
        if (!layered)
            continue;
        char *psave = NULL;
        int first = 1;
        for (char *path = strtok_r(eq + 1, ":", &psave); path; path = strtok_r(NULL, ":", &psave)) {
            if (nfds == (int)(sizeof fds / sizeof fds[0]))
                goto too_long;
            int fd = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
            if (fd < 0) {
                fprintf(stderr, "opening the overlay layer %s: %s\n", path, strerror(errno));
                goto done;
            }
            fds[nfds++] = fd;
            n = snprintf(out + len, sizeof out - len, "%s%d", first ? "" : ":", fd);
            if (n < 0 || (size_t)n >= sizeof out - len)
                goto too_long;
            len += (size_t)n;
            first = 0;
        }
    }
    if (chdir("/proc/self/fd") != 0) {
        fprintf(stderr, "chdir /proc/self/fd: %s\n", strerror(errno));
        goto done;
    }
    if (mount("overlay", target, "overlay", 0, out) != 0) {
        fprintf(stderr, "mount overlay on %s: %s\n", target, strerror(errno));
        goto done;
    }
    rc = chdir("/");
    goto done;
too_long:
    fprintf(stderr, "mount overlay on %s: options too long\n", target);
done:
    while (nfds > 0)
        close(fds[--nfds]);
    free(opts);
    return rc;
}

/* The sandbox's tree at ROOTFS replaces the host's as this namespace's root, and the init
 * (at the other end of sock) moves into it (see --own-root). */
static int own_root(const char *rootfs, int sock) {
    char byte;
    /* The init's first word: it has been exec'd. Until then crun's child may still need the
     * mounts under the first root that detaching the host's tree disconnects. */
    if (read(sock, &byte, 1) != 1 || byte != 'h') {
        fprintf(stderr, "own root: the sandbox's init did not start: %s\n", errno ? strerror(errno) : "it exited");
        return -1;
    }
    int tree = (int)syscall(SYS_open_tree, AT_FDCWD, rootfs, OPEN_TREE_CLONE | O_CLOEXEC | AT_RECURSIVE);
    if (tree < 0) {
        fprintf(stderr, "own root: cloning the sandbox's mounts at %s: %s\n", rootfs, strerror(errno));
        return -1;
    }
    int ns = open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
    if (ns < 0 || umount2("/", MNT_DETACH) != 0) {
        fprintf(stderr, "own root: detaching the host's root: %s\n", strerror(errno));
        return -1;
    }
    /* Back to the namespace's own root (what the detached host root was mounted on). */
    if (setns(ns, CLONE_NEWNS) != 0 || chdir("/") != 0) {
        fprintf(stderr, "own root: re-entering the mount namespace: %s\n", strerror(errno));
        return -1;
    }
    if (syscall(SYS_move_mount, tree, "", AT_FDCWD, "/", MOVE_MOUNT_F_EMPTY_PATH) != 0) {
        fprintf(stderr, "own root: attaching the sandbox's root: %s\n", strerror(errno));
        return -1;
    }
    char control[CMSG_SPACE(sizeof(int))] = {0};
    byte = 'r';
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof(control)};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &tree, sizeof(int));
    if (sendmsg(sock, &msg, MSG_NOSIGNAL) != 1 || read(sock, &byte, 1) != 1) {
        fprintf(stderr, "own root: the sandbox's init did not take its root: %s\n", errno ? strerror(errno) : "it exited");
        return -1;
    }
    if (byte != '1') {
        fprintf(stderr, "own root: the sandbox's init could not take its root (step %c)\n", byte);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    int cookie = 0, hide_net = 0, own = 0;
    while (argc > 1 && strncmp(argv[1], "--", 2) == 0) {
        if (strcmp(argv[1], "--new-core-cookie") == 0)
            cookie = 1;
        else if (strcmp(argv[1], "--hide-net-sysctls") == 0)
            hide_net = 1;
        else if (strcmp(argv[1], "--own-root") == 0)
            own = 1;
        else
            break;
        argc--;
        argv++;
    }
    if (argc < 4) {
        fprintf(stderr, "usage: dsec-rootfs [--new-core-cookie] [--hide-net-sysctls] [--own-root] OPTIONS ROOTFS PROGRAM [ARG...]\n");
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
    if (mount_overlay(argv[1], argv[2]) != 0)
        return 125;
    if (hide_net && mount("dsec-hidden", "/proc/sys/net", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                          "mode=0555,size=4k") != 0) {
        fprintf(stderr, "hiding /proc/sys/net: %s\n", strerror(errno));
        return 125;
    }
    if (cookie && prctl(PR_SCHED_CORE, PR_SCHED_CORE_CREATE, 0, PIDTYPE_TGID, 0) != 0) {
        fprintf(stderr, "core scheduling cookie: %s\n", strerror(errno));
        return 125;
    }
    /* What a failed exec reports to (closed by a good one); above 3, which --own-root hands on. */
    int err = fcntl(2, F_DUPFD_CLOEXEC, 10);
    int pair[2] = {-1, -1};
    if (own && socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
        fprintf(stderr, "socketpair: %s\n", strerror(errno));
        return 125;
    }
    pid_t child = own ? fork() : 0;
    if (child < 0) {
        fprintf(stderr, "fork: %s\n", strerror(errno));
        return 125;
    }
    if (child > 0) {
        int status;
        close(pair[1]);
        while (waitpid(child, &status, 0) < 0)
            if (errno != EINTR) {
                fprintf(stderr, "waiting for %s: %s\n", argv[3], strerror(errno));
                return 125;
            }
        if (!WIFEXITED(status))
            return 125;
        if (WEXITSTATUS(status) != 0)
            return WEXITSTATUS(status);
        errno = 0;
        return own_root(argv[2], pair[0]) == 0 ? 0 : 125;
    }
    int null = open("/dev/null", O_RDWR);
    if (err < 0 || null < 0 || dup2(null, 0) < 0 || dup2(null, 1) < 0 || dup2(null, 2) < 0 ||
        (own && (pair[1] == 3 ? fcntl(3, F_SETFD, 0) : dup2(pair[1], 3)) < 0)) {
        dprintf(err < 0 ? 2 : err, "redirecting stdio: %s\n", strerror(errno));
        return 125;
    }
    if (null > 3)
        close(null);
    execvp(argv[3], argv + 3);
    dprintf(err, "exec %s: %s\n", argv[3], strerror(errno));
    return 125;
}
