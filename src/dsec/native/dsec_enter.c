/*
 * dsec-enter: start a process inside a running container sandbox without `crun exec`.
 *
 *     dsec-enter --pid PID --start-time TICKS --cgroup dsec/SANDBOX_ID --spec-fd FD
 *                [--status-fd FD] [--uid UID] [--gid GID] [--cwd DIR] [--caps CAP_X,CAP_Y]
 *                [--seccomp-bpf FILE | --seccomp-rules RULES] [--nofile N] [--idle]
 *                [--share-core-cookie] [--own-domain] [--tty] [--raise-signal] [--pid-fd FD]
 *                [--hold-stdin FD] [--own-cgroup NAME] [--allow-setuid]
 *     dsec-enter --dump-seccomp --seccomp-rules RULES   (the filter's BPF program on stdout)
 *
 * The cost of `crun exec` grows with the number of sandboxes on a node (measured in the design
 * notes: 11 ms alone, 97 ms next to 9,000 containers). This helper only touches the sandbox's
 * own init process and cgroups:
 *
 *   1. opens /proc/PID once and checks the init's start time through that directory fd (a
 *      recycled PID cannot slip in afterwards: the fd stays bound to the process it named);
 *   2. opens the init's namespace files through the same fd, on the host's procfs; with
 *      --share-core-cookie takes the init's core scheduling cookie (PR_SCHED_CORE_SHARE_FROM
 *      PID, one task: ourselves), so the parent and the command share a physical SMT core only
 *      with the sandbox's own tasks; the start time is checked again after both (a PID reused
 *      meanwhile, whose cookie we might have taken, fails the check and nothing runs);
 *   3. refuses a paused sandbox (its freezer cgroup not THAWED: joining would freeze us), writes
 *      its own pid into DIR/cgroup.procs of every cgroup hierarchy under /sys/fs/cgroup that
 *      has DIR (= dsec/SANDBOX_ID), then checks that /proc/self/cgroup now equals the init's:
 *      everything forked later is charged to the sandbox; with --own-cgroup NAME it then
 *      moves into the cgroup2 child NAME of the sandbox's (made if missing; a hybrid host's
 *      cgroup2 tree has no controllers, so nothing is charged or limited differently): all the
 *      command forks stays there, whatever sessions or process groups it makes, so the edge
 *      ends all of it at once (cgroup.kill) and nothing of another command's;
 *   4. SCHED_IDLE if --idle; setns() into cgroup, ipc, uts, net, pid, time and last mnt (each
 *      only where it differs from ours; a different user namespace is refused). Joining the
 *      mount namespace sets root and cwd to that namespace's root, the container's rootfs
 *      (dsec-rootfs --own-root made it the root of the namespace crun used);
 *   5. forks once (the pid namespace applies to children only). The parent (host pid
 *      namespace, invisible from the sandbox) closes its stdin and stdout (the command's
 *      alone), sets its oom_score_adj to -1000 (it is charged to the sandbox's memory cgroup:
 *      the command must be the OOM victim, not it), forwards SIGTERM, SIGINT, SIGHUP,
 *      SIGQUIT, SIGUSR1, SIGUSR2 and SIGWINCH to the child and exits with its status, 128+N
 *      for a death by signal N, as `crun exec` reports it;
 *   6. the child keeps the process group and session it was started in (the edge kills the
 *      whole group on a timeout); sets RLIMIT_NOFILE (--nofile, else the init's), bounds the
 *      capability set to --caps, drops supplementary groups, setresgid/setresuid, leaves
 *      exactly --caps to uid 0 and nothing to any other user, umask 022, chdir(--cwd) with
 *      the final credentials, PR_SET_NO_NEW_PRIVS (unless --allow-setuid), PR_SET_PDEATHSIG
 *      (SIGKILL: a helper killed alone takes its command along), with --own-domain a Landlock
 *      domain of its own, the seccomp filter (both earlier with --allow-setuid), and execs
 *      argv with exactly the environment given, searching its PATH.
 *
 * --own-domain: every process a sandbox runs as the same user, so without it any of them may
 * ptrace any other, open its /proc/PID/fd/N (the pipes of a session shell, or of a grader's
 * command) or write its memory (process_vm_writev): a process the agent left running could
 * rewrite what a later grader's command reports. Landlock lets a process in a domain trace
 * only processes in the same domain or one nested in it (its ptrace check also guards /proc's
 * fd, mem, environ and process_vm_*), so each process the edge starts (exec, held process,
 * session shell) gets a domain of its own, shared by its descendants only. The domain
 * restricts nothing else: it handles only LANDLOCK_ACCESS_FS_REFER (cross-directory rename
 * and link, which any domain denies unless a rule grants it) and grants that beneath "/".
 * Needs Landlock ABI >= 2 (Linux 5.19; before, any domain denies cross-directory renames);
 * the edge passes the flag only where the kernel has it. From ABI 6 (Linux 6.12) the domain
 * also scopes signals (LANDLOCK_SCOPE_SIGNAL): a process left running cannot signal, nor
 * probe with kill(pid, 0), what a later caller runs (nor the reverse), while a process tree
 * signals its own members as before (a session's `kill %1`) and the helper, outside every
 * domain, forwards signals to its command. Abstract unix sockets stay unscoped: a server one
 * exec starts is a later exec's to connect to.
 *
 * The seccomp filter is the container's profile (backends/container/seccomp.py) compiled by
 * libseccomp as crun compiles it: --seccomp-rules takes the libseccomp calls crun makes for
 * that profile, one per line (`default ACTION`, `arch NAME`, `rule ACTION SYSCALL [ARG OP A B]...`,
 * numbers as strtoull reads them), and makes the same calls in the same order, so the program
 * is byte for byte the one crun stores for the container. Compiling costs ~0.5 ms, so the node
 * does it once (--dump-seccomp into a file of its own) and each spawn loads that file
 * (--seccomp-bpf), as `crun exec` loads the program crun stored; --seccomp-rules alone compiles
 * it on the spot instead.
 *
 * Nothing inside the sandbox is looked at with privileges: every path before the setns() is a
 * host path (/proc/PID/..., /sys/fs/cgroup/..., the seccomp program), the helper is
 * non-dumpable from its start (a sandbox process cannot open /proc/CHILD/exe, fd, ns or mem
 * while the child still holds privileges), closes the init's and the namespaces' fds before
 * the fork and lets no fd but 0-2 through the exec, and the child resolves cwd and argv[0]
 * only after dropping privileges.
 *
 * The command (argv and environment) comes on --spec-fd rather than the command line (a
 * memfd: values may be secrets and host `ps` shows command lines): NUL-terminated strings,
 * the first the decimal argc, then argv, then KEY=VALUE environment entries.
 *
 * Options for processes the edge keeps (a process table rather than one exec):
 *
 *   --tty           fds 0-2 are the slave of a pseudo-terminal the caller holds the master of:
 *                   the child makes a session of its own and takes the terminal as its
 *                   controlling one (setsid, TIOCSCTTY) before anything else, so job control,
 *                   ^C and SIGWINCH work as in a terminal; nothing else changes (caps, seccomp);
 *   --raise-signal  a child killed by signal N kills the helper with N (not exit 128+N), so the
 *                   caller can tell a death by signal from an exit code of 128+N;
 *   --pid-fd FD     "host PID\n" (the child's PID on the host, from the parent) and "ns PID\n"
 *                   (its PID in the sandbox, from the child itself) are written to FD, which
 *                   reaches EOF once both wrote (the child's copy closes on exec);
 *   --hold-stdin FD the write end of the pipe on stdin (a session shell's command stream),
 *                   with --pid-fd: a session shell, which idles by the thousand. The command
 *                   keeps FD itself, at fd 9 (SESSION_STDIN_FD, not close-on-exec), so the edge
 *                   holds no fd for it (it opens /proc/SHELL/fd/9 to write a command); the
 *                   child is forked with CLONE_PARENT, so it is the EDGE's child, and the
 *                   parent exits once it reported the PID: no helper process per session
 *                   (every process on the host lengthens the kernel's walks over every
 *                   task). The child's PR_SET_PDEATHSIG then follows the edge's
 *                   thread: an edge killed outright leaves no shell waiting forever. The
 *                   edge lets the shell go by killing it alone (its children live on).
 *
 * --allow-setuid (a sandbox that opted in, e.g. E2B's base with its passwordless sudo): no
 * PR_SET_NO_NEW_PRIVS, so a setuid-root program (sudo) raises a process to root. What root gets
 * that way is bounded by what survives every exec: the capability bounding set (--caps, what
 * a uid-0 command has: a setuid-root exec's permitted set is the bounding set, the inheritable
 * and ambient sets are empty), the seccomp filter, the Landlock domain, the cgroups and the
 * namespaces. The sandbox has no user namespace of its own, and its root is what a command
 * run as uid 0 already is. Without no_new_privs, installing a seccomp filter or a Landlock domain
 * needs CAP_SYS_ADMIN, so both are installed while the child still has the helper's
 * (host root, before setresuid), with the bounding set already cut to --caps; the filter
 * then also covers setresuid, capset, prctl, chdir and execve, which the profile allows.
 * Each process the helper starts stays in a Landlock domain of its own.
 *
 * Exit codes: 125 when the helper failed (the message is on stderr and on --status-fd; the
 * edge reports an infrastructure failure); 127 when argv[0] or the cwd does not exist, 126
 * when it cannot be run or entered (the command's failure, message on stderr, as a shell or
 * the other backends report it); else the command's own status. The status fd is
 * close-on-exec: the caller reads EOF once the command runs, or the helper's message.
 *
 * Build (Debian 12): gcc -static -O2 -Wall -Wextra -Werror -o dsec-enter dsec_enter.c -lseccomp
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/landlock.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <seccomp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define EXIT_HELPER 125
#define SESSION_STDIN_FD 9 /* POSIX sh redirects fds 0-9 only: the driver closes it for commands */
#define EXIT_CANNOT_RUN 126
#define EXIT_NOT_FOUND 127
#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define CGROUP_ROOT "/sys/fs/cgroup"

#ifndef CLONE_NEWTIME
#define CLONE_NEWTIME 0x00000080
#endif
#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif
#ifndef PR_SCHED_CORE
#define PR_SCHED_CORE 62
#define PR_SCHED_CORE_SHARE_FROM 3
#define PR_SCHED_CORE_SCOPE_THREAD 0
#endif

static int status_fd = -1;

static void write_all(int fd, const char *buf, size_t len)
{
	while (len > 0) {
		ssize_t n = write(fd, buf, len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return;
		buf += n;
		len -= (size_t)n;
	}
}

/* Report a failure of the helper itself (not of the command) and exit 125. */
static __attribute__((noreturn, format(printf, 2, 3))) void die(int err, const char *fmt, ...)
{
	char msg[1024];
	int n = snprintf(msg, sizeof msg, "dsec-enter: ");
	va_list ap;

	va_start(ap, fmt);
	n += vsnprintf(msg + n, sizeof msg - (size_t)n, fmt, ap);
	va_end(ap);
	if (n > (int)sizeof msg - 64)
		n = (int)sizeof msg - 64;
	if (err)
		n += snprintf(msg + n, sizeof msg - (size_t)n, ": %s", strerror(err));
	msg[n++] = '\n';
	write_all(2, msg, (size_t)n);
	if (status_fd >= 0)
		write_all(status_fd, msg, (size_t)n);
	_exit(EXIT_HELPER);
}

/* The command's own failure (missing program or cwd): on its stderr only, like a shell. */
static __attribute__((noreturn)) void command_failed(int err, const char *what, const char *name)
{
	char msg[PATH_MAX + 256];
	int n = snprintf(msg, sizeof msg, "dsec-enter: %s %s: %s\n", what, name, strerror(err));
	if (n > (int)sizeof msg - 1)
		n = (int)sizeof msg - 1;
	write_all(2, msg, (size_t)n);
	_exit(err == ENOENT ? EXIT_NOT_FOUND : EXIT_CANNOT_RUN);
}

static long long parse_num(const char *s, const char *what, long long min, long long max)
{
	char *end;
	long long v;

	errno = 0;
	v = strtoll(s, &end, 10);
	if (errno || end == s || *end || v < min || v > max)
		die(0, "bad %s: '%s'", what, s);
	return v;
}

/* -- the command, read from the spec fd ------------------------------------------------------ */

static char **cmd_argv, **cmd_envp;

static void read_spec(int fd)
{
	size_t cap = 1 << 16, len = 0;
	char *buf = malloc(cap);
	long long argc;
	size_t nstr = 0, i, k;
	char **strs;

	if (!buf)
		die(ENOMEM, "spec");
	for (;;) {
		ssize_t n;
		if (len == cap) {
			cap *= 2;
			buf = realloc(buf, cap);
			if (!buf)
				die(ENOMEM, "spec");
		}
		n = pread(fd, buf + len, cap - len, (off_t)len);
		if (n < 0 && errno == ESPIPE)
			n = read(fd, buf + len, cap - len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			die(errno, "read the spec fd %d", fd);
		if (n == 0)
			break;
		len += (size_t)n;
	}
	close(fd);
	if (len == 0 || buf[len - 1] != '\0')
		die(0, "the spec is not a list of NUL-terminated strings");
	for (i = 0; i < len; i++)
		nstr += buf[i] == '\0';
	strs = calloc(nstr + 2, sizeof *strs);
	if (!strs)
		die(ENOMEM, "spec");
	for (i = 0, k = 0; i < len; i += strlen(buf + i) + 1)
		strs[k++] = buf + i;
	argc = parse_num(strs[0], "argc in the spec", 1, (long long)nstr - 1);
	/* argv = strs[1..argc], NULL; envp = the rest, NULL (strs has room for both NULLs). */
	memmove(strs, strs + 1, (size_t)argc * sizeof *strs);
	strs[argc] = NULL;
	strs[nstr] = NULL;
	cmd_argv = strs;
	cmd_envp = strs + argc + 1;
}

/* -- the init process -------------------------------------------------------------------------- */

/* Its stat through the /proc/PID fd: start time (clock ticks since boot), or -1 if it is dead
 * or a zombie. */
static long long init_start_time(int procfd)
{
	char buf[4096], *p;
	ssize_t n;
	int fd = openat(procfd, "stat", O_RDONLY | O_CLOEXEC);
	int field;

	if (fd < 0)
		return -1;
	n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = '\0';
	p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
	if (!p || p[1] != ' ')
		return -1;
	p += 2;
	if (*p == 'Z' || *p == 'X')
		return -1;
	/* p is at field 3 (state); starttime is field 22. */
	for (field = 3; field < 22; field++) {
		p = strchr(p, ' ');
		if (!p)
			return -1;
		p++;
	}
	return strtoll(p, NULL, 10);
}

static ssize_t read_small(int dirfd, const char *name, char *buf, size_t cap)
{
	int fd = openat(dirfd, name, O_RDONLY | O_CLOEXEC);
	size_t len = 0;

	if (fd < 0)
		return -1;
	while (len < cap - 1) {
		ssize_t n = read(fd, buf + len, cap - 1 - len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			int e = errno;
			close(fd);
			errno = e;
			return -1;
		}
		if (n == 0)
			break;
		len += (size_t)n;
	}
	close(fd);
	buf[len] = '\0';
	return (ssize_t)len;
}

/* RLIMIT_NOFILE of the init (what crun gave the container), from /proc/PID/limits. */
static void init_nofile(int procfd, struct rlimit *out)
{
	char buf[4096], *line;
	rlim_t v[2];

	if (read_small(procfd, "limits", buf, sizeof buf) < 0)
		die(errno, "read the init's limits");
	line = strstr(buf, "\nMax open files ");
	if (!line)
		die(0, "no 'Max open files' in the init's limits");
	line += strlen("\nMax open files ");
	for (int i = 0; i < 2; i++) {
		while (*line == ' ')
			line++;
		if (!strncmp(line, "unlimited", 9)) {
			v[i] = RLIM_INFINITY;
			line += 9;
		} else {
			char *end;
			v[i] = strtoull(line, &end, 10);
			if (end == line)
				die(0, "unreadable 'Max open files' in the init's limits");
			line = end;
		}
	}
	out->rlim_cur = v[0];
	out->rlim_max = v[1];
}

/* -- cgroups ----------------------------------------------------------------------------------- */

static void check_cgroup_rel(const char *rel)
{
	const char *c = rel;

	if (!*rel || *rel == '/')
		die(0, "bad --cgroup '%s'", rel);
	while (*c) {
		const char *end = strchrnul(c, '/');
		size_t n = (size_t)(end - c);
		if (n == 0 || (n == 1 && c[0] == '.') || (n == 2 && c[0] == '.' && c[1] == '.'))
			die(0, "bad --cgroup '%s'", rel);
		for (const char *q = c; q < end; q++)
			if (!isalnum((unsigned char)*q) && *q != '-' && *q != '_' && *q != '.')
				die(0, "bad --cgroup '%s'", rel);
		c = *end ? end + 1 : end;
	}
}

/* Move this process into REL of every hierarchy mounted under /sys/fs/cgroup, then check that
 * it is where the init is, in every hierarchy. */
static void join_cgroups(int procfd, const char *rel)
{
	char path[PATH_MAX], pid[32], mine[4096], theirs[4096];
	int pidlen = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
	int joined = 0, rootfd;
	DIR *d = opendir(CGROUP_ROOT);
	struct dirent *e;

	if (!d)
		die(errno, "open %s", CGROUP_ROOT);
	rootfd = dirfd(d);
	/* Joining a frozen cgroup would freeze us too, with the caller waiting for an exec. */
	if (snprintf(path, sizeof path, "freezer/%s/freezer.state", rel) < (int)sizeof path &&
	    read_small(rootfd, path, mine, sizeof mine) > 0 && strncmp(mine, "THAWED", 6) != 0)
		die(0, "the sandbox is paused (freezer %.*s)", (int)strcspn(mine, "\n"), mine);
	while ((e = readdir(d)) != NULL) {
		struct stat st;
		int fd;

		if (e->d_name[0] == '.')
			continue;
		/* Symlinks (cpu -> cpu,cpuacct) name a hierarchy joined under its real name. */
		if (fstatat(rootfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISDIR(st.st_mode))
			continue;
		if (snprintf(path, sizeof path, "%s/%s/cgroup.procs", e->d_name, rel) >= (int)sizeof path)
			die(0, "cgroup path too long");
		fd = openat(rootfd, path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
		if (fd < 0) {
			if (errno == ENOENT)
				continue; /* not a hierarchy, or one the sandbox has no cgroup in */
			die(errno, "open %s/%s", CGROUP_ROOT, path);
		}
		if (write(fd, pid, (size_t)pidlen) != pidlen)
			die(errno, "join %s/%s", CGROUP_ROOT, path);
		close(fd);
		joined++;
	}
	closedir(d);
	if (joined == 0)
		die(0, "the sandbox has no cgroup %s under %s: is it still running?", rel, CGROUP_ROOT);
	if (read_small(procfd, "cgroup", theirs, sizeof theirs) < 0)
		die(errno, "read the init's cgroups");
	if (read_small(AT_FDCWD, "/proc/self/cgroup", mine, sizeof mine) < 0)
		die(errno, "read /proc/self/cgroup");
	if (strcmp(mine, theirs) != 0)
		die(0, "joined cgroups differ from the sandbox init's:\n%s--- init:\n%s", mine, theirs);
}

/* After join_cgroups: into the child NAME of the sandbox's cgroup2 directory, made if missing. */
static void join_own_cgroup(const char *rel, const char *name)
{
	char path[PATH_MAX], pid[32];
	int pidlen = snprintf(pid, sizeof pid, "%d\n", (int)getpid()), fd;

	if (snprintf(path, sizeof path, "%s/unified/%s/%s", CGROUP_ROOT, rel, name) >= (int)sizeof path)
		die(0, "cgroup path too long");
	if (mkdir(path, 0755) < 0 && errno != EEXIST)
		die(errno, "mkdir %s", path);
	strncat(path, "/cgroup.procs", sizeof path - strlen(path) - 1);
	fd = open(path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
	if (fd < 0)
		die(errno, "open %s", path);
	if (write(fd, pid, (size_t)pidlen) != pidlen)
		die(errno, "join %s", path);
	close(fd);
}

/* -- namespaces -------------------------------------------------------------------------------- */

struct ns {
	const char *name;
	int type;
	int fd;
};

/* In joining order: the mount namespace last (it changes root and cwd). */
static struct ns namespaces[] = {
	{ "cgroup", CLONE_NEWCGROUP, -1 }, { "ipc", CLONE_NEWIPC, -1 },
	{ "uts", CLONE_NEWUTS, -1 },       { "net", CLONE_NEWNET, -1 },
	{ "pid", CLONE_NEWPID, -1 },       { "time", CLONE_NEWTIME, -1 },
	{ "mnt", CLONE_NEWNS, -1 },
};
#define NNS (sizeof namespaces / sizeof namespaces[0])

static int same_ns(int procfd, const char *name, int selffd)
{
	char rel[64];
	struct stat a, b;

	snprintf(rel, sizeof rel, "ns/%s", name);
	if (fstatat(procfd, rel, &a, 0) < 0)
		die(errno, "stat the init's %s namespace", name);
	if (fstatat(selffd, rel, &b, 0) < 0)
		die(errno, "stat my %s namespace", name);
	return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

static void open_namespaces(int procfd)
{
	char rel[64];
	int selffd = open("/proc/self", O_RDONLY | O_DIRECTORY | O_CLOEXEC);

	if (selffd < 0)
		die(errno, "open /proc/self");
	if (!same_ns(procfd, "user", selffd))
		die(0, "the sandbox has a user namespace of its own: not supported");
	for (size_t i = 0; i < NNS; i++) {
		struct ns *ns = &namespaces[i];
		struct stat a, b;

		snprintf(rel, sizeof rel, "ns/%s", ns->name);
		ns->fd = openat(procfd, rel, O_RDONLY | O_CLOEXEC);
		if (ns->fd < 0) {
			if (errno == ENOENT && fstatat(selffd, rel, &b, 0) < 0)
				continue; /* a namespace kind this kernel lacks (time, cgroup) */
			die(errno, "open the init's %s namespace", ns->name);
		}
		if (fstat(ns->fd, &a) < 0 || fstatat(selffd, rel, &b, 0) < 0)
			die(errno, "stat the %s namespace", ns->name);
		if (a.st_dev == b.st_dev && a.st_ino == b.st_ino) {
			close(ns->fd); /* already ours (the sandbox does not isolate it) */
			ns->fd = -1;
		}
	}
	close(selffd);
}

static void enter_namespaces(void)
{
	for (size_t i = 0; i < NNS; i++) {
		struct ns *ns = &namespaces[i];
		if (ns->fd < 0)
			continue;
		if (setns(ns->fd, ns->type) < 0)
			die(errno, "setns into the sandbox's %s namespace", ns->name);
		close(ns->fd);
		ns->fd = -1;
	}
}

/* -- capabilities ------------------------------------------------------------------------------ */

#define CAP(x) { #x, x }
static const struct {
	const char *name;
	int value;
} cap_names[] = {
	CAP(CAP_CHOWN),	      CAP(CAP_DAC_OVERRIDE),	CAP(CAP_DAC_READ_SEARCH), CAP(CAP_FOWNER),
	CAP(CAP_FSETID),      CAP(CAP_KILL),		CAP(CAP_SETGID),	  CAP(CAP_SETUID),
	CAP(CAP_SETPCAP),     CAP(CAP_LINUX_IMMUTABLE), CAP(CAP_NET_BIND_SERVICE),
	CAP(CAP_NET_BROADCAST), CAP(CAP_NET_ADMIN),	CAP(CAP_NET_RAW),	  CAP(CAP_IPC_LOCK),
	CAP(CAP_IPC_OWNER),   CAP(CAP_SYS_MODULE),	CAP(CAP_SYS_RAWIO),	  CAP(CAP_SYS_CHROOT),
	CAP(CAP_SYS_PTRACE),  CAP(CAP_SYS_PACCT),	CAP(CAP_SYS_ADMIN),	  CAP(CAP_SYS_BOOT),
	CAP(CAP_SYS_NICE),    CAP(CAP_SYS_RESOURCE),	CAP(CAP_SYS_TIME),	  CAP(CAP_SYS_TTY_CONFIG),
	CAP(CAP_MKNOD),	      CAP(CAP_LEASE),		CAP(CAP_AUDIT_WRITE),	  CAP(CAP_AUDIT_CONTROL),
	CAP(CAP_SETFCAP),     CAP(CAP_MAC_OVERRIDE),	CAP(CAP_MAC_ADMIN),	  CAP(CAP_SYSLOG),
	CAP(CAP_WAKE_ALARM),  CAP(CAP_BLOCK_SUSPEND),	CAP(CAP_AUDIT_READ),	  CAP(CAP_PERFMON),
	CAP(CAP_BPF),	      CAP(CAP_CHECKPOINT_RESTORE),
};

static uint64_t parse_caps(const char *list)
{
	uint64_t set = 0;
	char *copy = strdup(list), *save = NULL;

	if (!copy)
		die(ENOMEM, "caps");
	for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		size_t i;
		for (i = 0; i < sizeof cap_names / sizeof cap_names[0]; i++)
			if (!strcasecmp(tok, cap_names[i].name))
				break;
		if (i == sizeof cap_names / sizeof cap_names[0])
			die(0, "unknown capability '%s'", tok);
		set |= 1ULL << cap_names[i].value;
	}
	free(copy);
	return set;
}

static void set_caps(uint64_t set)
{
	struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
	struct __user_cap_data_struct data[2];

	memset(data, 0, sizeof data);
	for (int i = 0; i < 2; i++) {
		data[i].effective = (uint32_t)(set >> (32 * i));
		data[i].permitted = (uint32_t)(set >> (32 * i));
		data[i].inheritable = 0;
	}
	if (syscall(SYS_capset, &hdr, data) < 0)
		die(errno, "capset");
}

static void bound_caps(uint64_t keep)
{
	for (int cap = 0; cap < 64; cap++) {
		if (prctl(PR_CAPBSET_READ, cap, 0, 0, 0) < 0)
			break; /* past the kernel's last capability */
		if (!(keep & (1ULL << cap)) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0)
			die(errno, "drop capability %d from the bounding set", cap);
	}
	if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
		die(errno, "clear the ambient capabilities");
}

/* -- seccomp ----------------------------------------------------------------------------------- */

static unsigned long long parse_datum(const char *tok, const char *line)
{
	char *end;
	unsigned long long v;

	errno = 0;
	v = strtoull(tok ? tok : "", &end, 0);
	if (!tok || errno || end == tok || *end)
		die(0, "bad number in seccomp rule '%s'", line);
	return v;
}

/* The profile as crun compiles it (libcrun_generate_seccomp): seccomp_init with the default
 * action, seccomp_arch_add for each architecture, then one seccomp_rule_add_array per rule, in
 * the order given (--seccomp-rules; seccomp.compiled_rules in Python already applied crun's
 * reading of the OCI profile). Built before the fork, loaded by the child. */
static scmp_filter_ctx build_filter(const char *rules)
{
	scmp_filter_ctx ctx = NULL;
	char *copy = strdup(rules), *save = NULL;
	int rc;

	if (!copy)
		die(ENOMEM, "seccomp rules");
	for (char *line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char shown[256], *lsave = NULL, *kind;

		snprintf(shown, sizeof shown, "%s", line); /* before strtok_r cuts it up */
		kind = strtok_r(line, " ", &lsave);
		if (!kind)
			continue;
		if (!strcmp(kind, "default")) {
			if (ctx)
				die(0, "a second 'default' in the seccomp rules");
			ctx = seccomp_init((uint32_t)parse_datum(strtok_r(NULL, " ", &lsave), shown));
			if (!ctx)
				die(0, "seccomp_init failed");
			continue;
		}
		if (!ctx)
			die(0, "the seccomp rules do not start with 'default'");
		if (!strcmp(kind, "arch")) {
			const char *name = strtok_r(NULL, " ", &lsave);
			uint32_t arch = name ? seccomp_arch_resolve_name(name) : 0;
			if (arch == 0)
				die(0, "unknown seccomp architecture in '%s'", shown);
			if ((rc = seccomp_arch_add(ctx, arch)) < 0 && rc != -EEXIST)
				die(-rc, "seccomp: add arch %s", name);
		} else if (!strcmp(kind, "rule")) {
			uint32_t action = (uint32_t)parse_datum(strtok_r(NULL, " ", &lsave), shown);
			const char *name = strtok_r(NULL, " ", &lsave);
			struct scmp_arg_cmp cmp[6];
			unsigned int n = 0;
			int nr;

			if (!name)
				die(0, "no system call in seccomp rule '%s'", shown);
			for (char *tok; (tok = strtok_r(NULL, " ", &lsave)) != NULL; n++) {
				if (n == 6)
					die(0, "more than 6 comparisons in seccomp rule '%s'", shown);
				cmp[n].arg = (unsigned int)parse_datum(tok, shown);
				cmp[n].op = (enum scmp_compare)parse_datum(strtok_r(NULL, " ", &lsave), shown);
				cmp[n].datum_a = parse_datum(strtok_r(NULL, " ", &lsave), shown);
				cmp[n].datum_b = parse_datum(strtok_r(NULL, " ", &lsave), shown);
			}
			nr = seccomp_syscall_resolve_name(name);
			if (nr == __NR_SCMP_ERROR)
				continue; /* as crun: a name this libseccomp does not know is skipped */
			rc = seccomp_rule_add_array(ctx, action, nr, n, cmp);
			if (rc < 0)
				die(-rc, "seccomp rule '%s'", shown);
		} else {
			die(0, "bad seccomp rule '%s'", shown);
		}
	}
	free(copy);
	if (!ctx)
		die(0, "no seccomp rules");
	return ctx;
}

/* A filter program compiled before (--dump-seccomp), read from a host file. */
static struct sock_fprog read_bpf(const char *path)
{
	struct sock_fprog prog = { 0, NULL };
	struct stat st;
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
	size_t len = 0;

	if (fd < 0 || fstat(fd, &st) < 0)
		die(errno, "open the seccomp program %s", path);
	if (!S_ISREG(st.st_mode) || st.st_size == 0 || st.st_size % sizeof(struct sock_filter) ||
	    st.st_size > BPF_MAXINSNS * (off_t)sizeof(struct sock_filter))
		die(0, "%s is not a seccomp program", path);
	prog.filter = malloc((size_t)st.st_size);
	if (!prog.filter)
		die(ENOMEM, "seccomp program");
	while (len < (size_t)st.st_size) {
		ssize_t n = read(fd, (char *)prog.filter + len, (size_t)st.st_size - len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			die(n < 0 ? errno : 0, "read the seccomp program %s", path);
		len += (size_t)n;
	}
	close(fd);
	prog.len = (unsigned short)(len / sizeof(struct sock_filter));
	return prog;
}

/* -- exec -------------------------------------------------------------------------------------- */

/* execvpe() with the PATH of the given environment (not ours), glibc's error rules. */
static void exec_path(char *const argv[], char *const envp[])
{
	const char *file = argv[0], *path = DEFAULT_PATH, *end;
	size_t flen = strlen(file);
	int eacces = 0;
	char buf[PATH_MAX];

	if (!*file) {
		errno = ENOENT;
		return;
	}
	if (strchr(file, '/')) {
		execve(file, argv, envp);
		return;
	}
	for (char *const *e = envp; *e; e++)
		if (!strncmp(*e, "PATH=", 5)) {
			path = *e + 5;
			break;
		}
	for (const char *dir = path;; dir = end + 1) {
		size_t dlen;
		end = strchrnul(dir, ':');
		dlen = (size_t)(end - dir);
		if (dlen + 1 + flen + 1 <= sizeof buf) {
			memcpy(buf, dir, dlen);
			if (dlen > 0) /* an empty PATH element means the current directory */
				buf[dlen++] = '/';
			memcpy(buf + dlen, file, flen + 1);
			execve(buf, argv, envp);
			switch (errno) {
			case EACCES:
				eacces = 1;
				break;
			case ENOENT: case ENOTDIR: case ESTALE: case ENODEV: case ETIMEDOUT:
			case ELOOP: case ENAMETOOLONG:
				break;
			default:
				return; /* e.g. ENOEXEC, E2BIG: report this one */
			}
		}
		if (!*end)
			break;
	}
	errno = eacces ? EACCES : ENOENT;
}

/* -- main -------------------------------------------------------------------------------------- */

struct opts {
	long long pid, start_time;
	const char *cgroup, *cwd, *caps, *rules, *bpf;
	uid_t uid;
	gid_t gid;
	int spec_fd, idle, dump_seccomp, tty, raise_signal, pid_fd, hold_fd, share_cookie;
	int own_domain, allow_setuid;
	const char *own_cgroup;
	pid_t edge;
	struct rlimit nofile;
	int have_nofile;
};

static void parse_opts(int argc, char **argv, struct opts *o)
{
	static const struct option longopts[] = {
		{ "pid", required_argument, NULL, 'p' },      { "start-time", required_argument, NULL, 't' },
		{ "cgroup", required_argument, NULL, 'g' },   { "spec-fd", required_argument, NULL, 's' },
		{ "status-fd", required_argument, NULL, 'S' }, { "uid", required_argument, NULL, 'u' },
		{ "gid", required_argument, NULL, 'G' },      { "cwd", required_argument, NULL, 'c' },
		{ "caps", required_argument, NULL, 'C' },     { "seccomp-rules", required_argument, NULL, 'd' },
		{ "nofile", required_argument, NULL, 'n' },   { "idle", no_argument, NULL, 'i' },
		{ "dump-seccomp", no_argument, NULL, 'D' },   { "seccomp-bpf", required_argument, NULL, 'B' },
		{ "tty", no_argument, NULL, 'T' },            { "raise-signal", no_argument, NULL, 'R' },
		{ "pid-fd", required_argument, NULL, 'P' },  { "hold-stdin", required_argument, NULL, 'H' },
		{ "share-core-cookie", no_argument, NULL, 'K' }, { "own-domain", no_argument, NULL, 'L' },
		{ "own-cgroup", required_argument, NULL, 'O' }, { "allow-setuid", no_argument, NULL, 'U' },
		{ NULL, 0, NULL, 0 },
	};
	int c;

	memset(o, 0, sizeof *o);
	o->pid = o->start_time = -1;
	o->spec_fd = -1;
	o->pid_fd = -1;
	o->hold_fd = -1;
	o->cwd = "/";
	o->caps = "";
	o->rules = NULL;
	while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		switch (c) {
		case 'p': o->pid = parse_num(optarg, "--pid", 1, INT_MAX); break;
		case 't': o->start_time = parse_num(optarg, "--start-time", 0, LLONG_MAX); break;
		case 'g': o->cgroup = optarg; break;
		case 's': o->spec_fd = (int)parse_num(optarg, "--spec-fd", 0, INT_MAX); break;
		case 'S': status_fd = (int)parse_num(optarg, "--status-fd", 0, INT_MAX); break;
		case 'u': o->uid = (uid_t)parse_num(optarg, "--uid", 0, UINT32_MAX - 1); break;
		case 'G': o->gid = (gid_t)parse_num(optarg, "--gid", 0, UINT32_MAX - 1); break;
		case 'c': o->cwd = optarg; break;
		case 'C': o->caps = optarg; break;
		case 'd': o->rules = optarg; break;
		case 'B': o->bpf = optarg; break;
		case 'n':
			o->nofile.rlim_cur = o->nofile.rlim_max =
				(rlim_t)parse_num(optarg, "--nofile", 0, LLONG_MAX);
			o->have_nofile = 1;
			break;
		case 'i': o->idle = 1; break;
		case 'K': o->share_cookie = 1; break;
		case 'L': o->own_domain = 1; break;
		case 'O': o->own_cgroup = optarg; break;
		case 'U': o->allow_setuid = 1; break;
		case 'D': o->dump_seccomp = 1; break;
		case 'T': o->tty = 1; break;
		case 'R': o->raise_signal = 1; break;
		case 'P': o->pid_fd = (int)parse_num(optarg, "--pid-fd", 0, INT_MAX); break;
		case 'H': o->hold_fd = (int)parse_num(optarg, "--hold-stdin", 3, INT_MAX); break;
		default: die(0, "usage: see the comment at the top of dsec_enter.c");
		}
	}
	if (optind != argc)
		die(0, "unexpected argument '%s'", argv[optind]);
	if (o->dump_seccomp)
		return;
	if (o->pid < 0 || o->start_time < 0 || !o->cgroup || o->spec_fd < 0)
		die(0, "--pid, --start-time, --cgroup and --spec-fd are required");
	check_cgroup_rel(o->cgroup);
	if (o->own_cgroup) {
		if (strchr(o->own_cgroup, '/'))
			die(0, "bad --own-cgroup '%s'", o->own_cgroup);
		check_cgroup_rel(o->own_cgroup);
	}
}

/* struct landlock_ruleset_attr as of Landlock ABI 6 (Linux 6.12): the libc headers a node
 * builds with may be older. A kernel of an older ABI takes the longer struct as long as the
 * fields it does not know are zero. */
struct ruleset_attr_v6 {
	__u64 handled_access_fs;
	__u64 handled_access_net;
	__u64 scoped;
};
#define SCOPE_SIGNAL (1ULL << 1) /* LANDLOCK_SCOPE_SIGNAL */

/* A Landlock domain that restricts nothing but tracing and, from ABI 6, signalling across
 * domains (see the top). */
static void enter_own_domain(void)
{
	struct ruleset_attr_v6 attr = { .handled_access_fs = LANDLOCK_ACCESS_FS_REFER };
	struct landlock_path_beneath_attr beneath = { .allowed_access = LANDLOCK_ACCESS_FS_REFER };
	long abi = syscall(__NR_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);

	if (abi >= 6)
		attr.scoped = SCOPE_SIGNAL;
	int ruleset = (int)syscall(__NR_landlock_create_ruleset, &attr, sizeof attr, 0);

	if (ruleset < 0)
		die(errno, "create a Landlock ruleset (--own-domain needs Landlock ABI >= 2)");
	beneath.parent_fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (beneath.parent_fd < 0)
		die(errno, "open the sandbox's root");
	if (syscall(__NR_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH, &beneath, 0) < 0)
		die(errno, "grant renames beneath the sandbox's root");
	if (syscall(__NR_landlock_restrict_self, ruleset, 0) < 0)
		die(errno, "enter a Landlock domain of our own");
	close(beneath.parent_fd);
	close(ruleset);
}

/* The Landlock domain (--own-domain) and the seccomp filter: irrevocable, inherited by every
 * exec, setuid ones included. */
static void confine(const struct opts *o, scmp_filter_ctx filter, const struct sock_fprog *prog)
{
	if (o->own_domain)
		enter_own_domain();
	if (prog->filter) {
		if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, prog) < 0)
			die(errno, "load the seccomp program");
	} else if (seccomp_load(filter) < 0) {
		die(errno, "seccomp_load");
	}
}

static const int forwarded[] = { SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH };

static void report_pid(int fd, const char *which, pid_t pid)
{
	char line[64];
	int n = snprintf(line, sizeof line, "%s %d\n", which, (int)pid);

	if (fd >= 0)
		write_all(fd, line, (size_t)n);
}

static __attribute__((noreturn)) void parent(pid_t child, const sigset_t *waitset, int oom_fd,
					     const struct opts *o)
{
	int status;

	report_pid(o->pid_fd, "host", child);
	if (o->pid_fd >= 0)
		close(o->pid_fd);
	close(status_fd); /* the child's copy alone tells the caller about the exec */
	status_fd = -1;
	if (o->hold_fd >= 0)
		_exit(0); /* a session shell: the edge's own child, which it reaps */
	close(0); /* stdin and stdout are the command's: no second holder of the pipes */
	close(1);
	/* Tiny, and charged to the sandbox's memory cgroup: never the OOM victim (the child was
	 * forked before, it keeps the edge's setting). */
	if (oom_fd >= 0) {
		write_all(oom_fd, "-1000", 5);
		close(oom_fd);
	}
	for (;;) {
		siginfo_t info;
		int sig = sigwaitinfo(waitset, &info);
		if (sig < 0) {
			if (errno == EINTR)
				continue;
			die(errno, "sigwaitinfo");
		}
		if (sig != SIGCHLD) {
			kill(child, sig);
			continue;
		}
		for (;;) {
			pid_t r = waitpid(child, &status, WNOHANG);
			if (r == child)
				goto done;
			if (r < 0 && errno == ECHILD)
				die(errno, "waitpid");
			if (r == 0 || r < 0)
				break;
		}
	}
done:
	if (WIFSIGNALED(status) && o->raise_signal) {
		/* Die the same way (non-dumpable: no core file); a signal that cannot kill us
		 * falls through to the exit code. */
		int sig = WTERMSIG(status);
		sigset_t one;

		signal(sig, SIG_DFL);
		sigemptyset(&one);
		sigaddset(&one, sig);
		sigprocmask(SIG_UNBLOCK, &one, NULL);
		raise(sig);
	}
	if (WIFSIGNALED(status))
		_exit(128 + WTERMSIG(status)); /* as crun exec reports a death by signal */
	_exit(WEXITSTATUS(status));
}

static __attribute__((noreturn)) void child(const struct opts *o, uint64_t caps,
					    scmp_filter_ctx filter, const struct sock_fprog *prog,
					    int helper_pidfd)
{
	sigset_t none;

	report_pid(o->pid_fd, "ns", getpid()); /* closes on exec, or when we fail */
	if (o->tty) {
		/* Still privileged, before seccomp: the same filter and caps as without a tty. */
		if (setsid() < 0)
			die(errno, "setsid");
		if (ioctl(0, TIOCSCTTY, 0) < 0)
			die(errno, "take the terminal on stdin as the controlling one");
	}
	if (setrlimit(RLIMIT_NOFILE, &o->nofile) < 0) /* may raise: before the caps go */
		die(errno, "setrlimit(RLIMIT_NOFILE)");
	bound_caps(caps);
	/* Without no_new_privs, only now (CAP_SYS_ADMIN, dropped below) may we confine ourselves. */
	if (o->allow_setuid)
		confine(o, filter, prog);
	if (setgroups(0, NULL) < 0)
		die(errno, "setgroups");
	if (setresgid(o->gid, o->gid, o->gid) < 0)
		die(errno, "setresgid(%u)", (unsigned)o->gid);
	if (setresuid(o->uid, o->uid, o->uid) < 0)
		die(errno, "setresuid(%u)", (unsigned)o->uid);
	set_caps(o->uid == 0 ? caps : 0); /* another user lost them with setresuid: make sure */
	umask(022);
	if (!o->allow_setuid && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		die(errno, "PR_SET_NO_NEW_PRIVS");
	/* Die with the helper (a helper killed alone must not leave its command running), or with
	 * the edge's thread for a session shell, forked with CLONE_PARENT. */
	if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
		die(errno, "PR_SET_PDEATHSIG");
	{
		/* Or did it die before? Its pidfd is readable once it exited. (getppid() cannot
		 * tell: the helper's pid, and that of the host's reaper, are 0 to us.) */
		struct pollfd pf = { helper_pidfd, POLLIN, 0 };
		if (poll(&pf, 1, 0) != 0)
			_exit(EXIT_HELPER); /* nobody waits for us */
		close(helper_pidfd);
	}
	/* As the final user, inside the sandbox's root: permissions apply, symlinks stay inside. */
	if (chdir(o->cwd) < 0)
		command_failed(errno, "cannot enter the working directory", o->cwd);
	if (!o->allow_setuid) /* after no-new-privs, which an unprivileged user needs for both */
		confine(o, filter, prog);
	/* Fds 0-2 are the command's; any other (the status pipe included) closes on exec. */
	if (syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC) < 0) {
		long max = sysconf(_SC_OPEN_MAX);
		for (int fd = 3; fd < (max > 0 ? max : 65536); fd++)
			fcntl(fd, F_SETFD, FD_CLOEXEC);
	}
	/* A session shell holds the write end of its own stdin, through the exec. */
	if (o->hold_fd >= 0 && (o->hold_fd == SESSION_STDIN_FD ? fcntl(SESSION_STDIN_FD, F_SETFD, 0)
							       : dup2(o->hold_fd, SESSION_STDIN_FD)) < 0)
		die(errno, "keep the session's stdin at fd %d", SESSION_STDIN_FD);
	for (int s = 1; s < NSIG; s++)
		signal(s, SIG_DFL);
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	exec_path(cmd_argv, cmd_envp);
	command_failed(errno, "cannot run", cmd_argv[0]);
}

int main(int argc, char **argv)
{
	struct opts o;
	scmp_filter_ctx filter = NULL;
	struct sock_fprog prog = { 0, NULL };
	uint64_t caps;
	sigset_t waitset;
	int procfd, oom_fd;
	long long started;
	pid_t pid;
	int helper_pidfd;

	/* First of all: nothing in the sandbox may open our /proc files (exe, fd, ns, mem). */
	if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0)
		die(errno, "PR_SET_DUMPABLE");
	parse_opts(argc, argv, &o);
	o.edge = getppid();
	if (status_fd >= 0 && fcntl(status_fd, F_SETFD, FD_CLOEXEC) < 0)
		die(errno, "bad --status-fd");
	if (o.pid_fd >= 0 && fcntl(o.pid_fd, F_SETFD, FD_CLOEXEC) < 0)
		die(errno, "bad --pid-fd");
	if (o.hold_fd >= 0 && fcntl(o.hold_fd, F_SETFD, FD_CLOEXEC) < 0)
		die(errno, "bad --hold-stdin");
	if (o.hold_fd >= 0 && o.pid_fd < 0)
		die(0, "--hold-stdin needs --pid-fd (the edge must learn the shell's PID)");
	signal(SIGCHLD, SIG_DFL); /* an inherited SIG_IGN would reap the child behind our back */
	if (o.bpf && !o.dump_seccomp)
		prog = read_bpf(o.bpf);
	else
		filter = build_filter(o.rules ? o.rules : "");
	if (o.dump_seccomp) {
		if (seccomp_export_bpf(filter, 1) < 0)
			die(0, "seccomp_export_bpf failed");
		return 0;
	}
	caps = parse_caps(o.caps);
	read_spec(o.spec_fd);

	{
		char path[64];
		snprintf(path, sizeof path, "/proc/%lld", o.pid);
		procfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	}
	if (procfd < 0)
		die(errno == ENOENT ? 0 : errno, "the sandbox's init (pid %lld) is gone", o.pid);
	started = init_start_time(procfd);
	if (started != o.start_time)
		die(0, "pid %lld is not the sandbox's init (start time %lld, expected %lld): the "
		       "sandbox is gone", o.pid, started, o.start_time);
	open_namespaces(procfd);
	if (!o.have_nofile)
		init_nofile(procfd, &o.nofile);
	/* The edge asks only for a sandbox whose init got a cookie at start: fail rather than run
	 * the command beside other sandboxes' tasks. Before the fork: the child inherits it. */
	if (o.share_cookie &&
	    prctl(PR_SCHED_CORE, PR_SCHED_CORE_SHARE_FROM, (unsigned long)o.pid,
		  PR_SCHED_CORE_SCOPE_THREAD, 0UL) < 0)
		die(errno, "take the sandbox init's core scheduling cookie (PR_SCHED_CORE_SHARE_FROM %lld)",
		    o.pid);
	/* Through the same fd, so it is the same process: still alive after all of the above. */
	if (init_start_time(procfd) != o.start_time)
		die(0, "the sandbox's init (pid %lld) died while entering", o.pid);
	join_cgroups(procfd, o.cgroup);
	if (o.own_cgroup)
		join_own_cgroup(o.cgroup, o.own_cgroup);
	close(procfd);
	/* Opened while /proc is still the host's: after setns(mnt) it is the sandbox's. */
	oom_fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
	if (o.idle) {
		struct sched_param sp = { 0 };
		if (sched_setscheduler(0, SCHED_IDLE, &sp) < 0)
			die(errno, "SCHED_IDLE");
	}
	enter_namespaces();

	/* Who the child dies with: us, or the edge for a session shell (our parent: the edge or
	 * its spawner forked us with CLONE_PARENT). Close-on-exec. */
	helper_pidfd = (int)syscall(SYS_pidfd_open, o.hold_fd >= 0 ? o.edge : getpid(), 0);
	if (helper_pidfd < 0)
		die(errno, "pidfd_open");
	sigemptyset(&waitset);
	for (size_t i = 0; i < sizeof forwarded / sizeof forwarded[0]; i++)
		sigaddset(&waitset, forwarded[i]);
	sigaddset(&waitset, SIGCHLD);
	if (sigprocmask(SIG_BLOCK, &waitset, NULL) < 0)
		die(errno, "sigprocmask");
	/* A session shell becomes the edge's child: raw clone, as fork but with CLONE_PARENT (we
	 * are single-threaded: none of glibc's fork-time handling is needed). */
	pid = o.hold_fd >= 0 ? (pid_t)syscall(SYS_clone, CLONE_PARENT | SIGCHLD, 0, NULL, NULL, 0) : fork();
	if (pid < 0)
		die(errno, "fork into the sandbox%s",
		    errno == EAGAIN ? " (its pids limit reached?)" : "");
	if (pid > 0) {
		close(helper_pidfd);
		parent(pid, &waitset, oom_fd, &o);
	}
	if (oom_fd >= 0)
		close(oom_fd);
	child(&o, caps, filter, &prog, helper_pidfd);
}
